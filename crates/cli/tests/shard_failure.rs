//! A shard killed with SIGKILL mid-way: I/O goes on once the metadata service marks it down;
//! restarted on its data directory it comes back up; a replacement with an EMPTY data directory
//! and the same id is refilled by re-replication (checked by reading after killing two other
//! shards, so that some objects are left only on the replacement).

mod common;

use std::time::Duration;

use common::*;

const STATE_TIMEOUT: Duration = Duration::from_secs(60);

#[test]
fn io_goes_on_through_a_dead_shard_and_a_replacement_is_refilled() {
    require_qemu();
    // `up` would restart the killed shard itself: this test restarts and replaces it.
    let mut up = Up::start_with(4, &["--restart-after-ms", "0"]);
    up.ok(&["volume", "create", "vol", "--size", "32M"]);
    let uri = up.uri("vol");
    qemu_ok(&uri, &["write -P 0x31 0 2M"]);

    // Kill shard 2 mid-way: writes may stall until it is marked down, then go on.
    let victim = up.shard_pid(2);
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    qemu_ok(&uri, &["write -P 0x32 0 2M", "read -P 0x32 0 2M"]);
    up.wait_shard(2, "Down", STATE_TIMEOUT);
    qemu_ok(&uri, &["write -P 0x33 2M 2M", "read -P 0x32 0 2M", "read -P 0x33 2M 2M"]);

    // Restart it on the same data directory: it catches up and is up again.
    let shard2 = up.shard(2).clone();
    let (addr, dir) = (shard2["addr"].as_str().unwrap().to_string(), shard2["dir"].as_str().unwrap().to_string());
    let (meta, secret) = (up.meta_addr(), up.secret_file().to_string_lossy().into_owned());
    let log = up.dir.path().join("shard-2-restarted.log");
    let restarted = up.spawn(&["shard", "--id", "2", "--dir", &dir, "--listen", &addr, "--meta", &meta, "--secret-file", &secret], &log);
    up.wait_shard(2, "Up", STATE_TIMEOUT);
    qemu_ok(&uri, &["read -P 0x32 0 2M", "read -P 0x33 2M 2M"]);

    // Kill it again and replace it with an empty data directory and the same id.
    up.kill_extra(restarted);
    up.wait_shard(2, "Down", STATE_TIMEOUT);
    qemu_ok(&uri, &["write -P 0x34 4M 1M"]);
    let empty = up.dir.path().join("shard-2-replacement");
    let log = up.dir.path().join("shard-2-replacement.log");
    let empty_s = empty.to_string_lossy().into_owned();
    up.spawn(&["shard", "--id", "2", "--dir", &empty_s, "--listen", &addr, "--meta", &meta, "--secret-file", &secret, "--create"], &log);
    up.wait_shard(2, "Up", STATE_TIMEOUT);
    // The proof that re-replication filled it comes next: with shards 1 and 3 dead, the slots
    // placed on {1, 3, 2} live only on the replacement, and every pattern must read back.

    // Kill two other shards: every slot keeps one live replica, and some only on shard 2.
    for id in [1, 3] {
        // SAFETY: as above.
        unsafe { libc::kill(up.shard_pid(id) as i32, libc::SIGKILL) };
    }
    up.wait_shard(1, "Down", STATE_TIMEOUT);
    up.wait_shard(3, "Down", STATE_TIMEOUT);
    qemu_ok(&uri, &["read -P 0x32 0 2M", "read -P 0x33 2M 2M", "read -P 0x34 4M 1M", "read -P 0 5M 1M"]);
    // And writes still go through on what is left.
    qemu_ok(&uri, &["write -P 0x35 6M 256k", "read -P 0x35 6M 256k"]);
}
