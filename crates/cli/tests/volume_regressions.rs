//! Volume-layer bugs found while building the CLI, now fixed: each test reproduces one through
//! the real binary and real clients.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// A session opened on a `super` child before it was promoted keeps the child's `VolRef` with
/// `parent: Some(old parent)`. The shard's write path only consults its tracking entries when
/// `vol.parent.is_none()` (`volume::core::shard`, `start_write`), so after the promoted volume gets a
/// super child of its own, writes through that session are never tracked: the dirty bit stays
/// clear and `collapse` promotes the new child although its parent was written after `super`.
#[test]
fn stale_child_session_writes_are_tracked() {
    require_qemu();
    let up = Up::start(4);
    up.ok(&["volume", "create", "p", "--size", "8M"]);
    qemu_ok(&up.uri("p"), &["write -P 0x11 0 1M"]);
    let c = up.ok(&["volume", "super", "p"]).trim().to_string();
    let mut app = QemuSession::open(&up.uri(&c)); // the recovering application
    assert!(app.cmd("write -P 0x22 0 4k").0);
    assert_eq!(up.ok(&["volume", "collapse", &c]).trim(), "promoted");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v: serde_json::Value = serde_json::from_str(&up.ok(&["volume", "info", &c, "--json"])).unwrap();
        if v["vol"]["parent"].is_null() {
            break;
        }
        assert!(Instant::now() < deadline, "GC did not finish");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The application goes on on the promoted volume; a new super is made of it.
    up.ok(&["volume", "super", &c, "--child", "d"]);
    assert!(app.cmd("write -P 0x33 64k 4k").0, "a parent write after super is allowed (and must set the dirty bit)");
    assert_eq!(up.ok(&["volume", "collapse", "d"]).trim(), "rejected", "the parent was written after super");
}

/// A shard that missed writes while down restarts its re-replication whenever the map changes
/// (here: the other shards coming up one after another after a whole-cluster restart). Pull
/// replies of the abandoned round still arrive and decrement the new round's `pulls_in_flight`
/// (`volume::core::shard`, `on_recovery_reply`): "attempt to subtract with overflow" in debug builds
/// (the shard exits), a wrapped counter that stalls re-replication in release builds.
#[test]
fn whole_cluster_restart_after_a_shard_missed_writes() {
    require_qemu();
    // Left down by `up` (not restarted), so that it misses the writes.
    let mut up = Up::start_with(4, &["--restart-after-ms", "0"]);
    up.ok(&["volume", "create", "r", "--size", "16M"]);
    qemu_ok(&up.uri("r"), &["write -P 0xaa 0 2M"]);
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(up.shard_pid(2) as i32, libc::SIGKILL) };
    qemu_ok(&up.uri("r"), &["write -P 0xbb 0 2M"]);
    up.restart();
    qemu_ok(&up.uri("r"), &["read -P 0xbb 0 2M"]);
}

/// Issue 22 §2 in the volume service: a metadata service stopped past `--down-after-ms` (3 s;
/// SIGSTOP here, a loaded machine in practice) took its own silence for the shards' and marked
/// every shard down — and not in sync — at once on waking, before reading the answers waiting in
/// its sockets. Now silence counts only while the service runs: on waking nothing changes.
#[test]
fn a_paused_metadata_service_marks_no_shard_down_on_waking() {
    let up = Up::start(3);
    for id in 1..=3 {
        up.wait_shard(id, "Up", Duration::from_secs(60));
    }
    let epoch = || -> u64 {
        let v: serde_json::Value = serde_json::from_str(&up.ok(&["status", "--json"])).unwrap();
        v["map"]["epoch"].as_u64().unwrap()
    };
    let before = epoch();
    let meta = up.info["meta"]["pid"].as_u64().unwrap() as i32;
    /// Continues the metadata service even if the test fails while it is stopped.
    struct Cont(i32);
    impl Drop for Cont {
        fn drop(&mut self) {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe { libc::kill(self.0, libc::SIGCONT) };
        }
    }
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(meta, libc::SIGSTOP) }, 0);
    let cont = Cont(meta);
    std::thread::sleep(Duration::from_millis(4_500));
    drop(cont);
    // Every shard answers its pings throughout: none may be marked down, now or later.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let states = up.shard_states();
        assert!(states.iter().all(|(_, s)| s == "Up"), "after a 4.5 s pause of the metadata service: {states:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(epoch(), before, "the map changed across the pause of the metadata service");
}
