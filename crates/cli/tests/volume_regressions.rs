//! Volume-layer bugs found while building the CLI, now fixed: each test reproduces one through
//! the real binary and real clients.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// A session opened on a `super` child before it was promoted keeps the child's `VolRef` with
/// `parent: Some(old parent)`. The shard's write path only consults its tracking entries when
/// `vol.parent.is_none()` (shard_core.rs, `start_write`), so after the promoted volume gets a
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
/// (shard_core.rs, `on_recovery_reply`): "attempt to subtract with overflow" in debug builds
/// (the shard exits), a wrapped counter that stalls re-replication in release builds.
#[test]
fn whole_cluster_restart_after_a_shard_missed_writes() {
    require_qemu();
    let mut up = Up::start(4);
    up.ok(&["volume", "create", "r", "--size", "16M"]);
    qemu_ok(&up.uri("r"), &["write -P 0xaa 0 2M"]);
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(up.shard_pid(2) as i32, libc::SIGKILL) };
    qemu_ok(&up.uri("r"), &["write -P 0xbb 0 2M"]);
    up.restart();
    qemu_ok(&up.uri("r"), &["read -P 0xbb 0 2M"]);
}
