//! Volume-layer bugs found while building the CLI, kept as ignored tests until fixed in
//! `crates/volume` (run them with `cargo test -p understudy --test known_volume_bugs -- --ignored`).

mod common;

use std::time::{Duration, Instant};

use common::*;

/// A session opened on a `super` child before it was promoted keeps the child's `VolRef` with
/// `parent: Some(old parent)`. The shard's write path only consults its tracking entries when
/// `vol.parent.is_none()` (shard_core.rs, `start_write`), so after the promoted volume gets a
/// super child of its own, writes through that session are never tracked: the dirty bit stays
/// clear and `collapse` promotes the new child although its parent was written after `super`.
#[test]
#[ignore = "volume bug: writes through a pre-promotion child session bypass super tracking"]
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
