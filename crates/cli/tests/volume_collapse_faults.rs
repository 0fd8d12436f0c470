//! `collapse` over broken connections, with real processes and sockets: the caller dies in the
//! middle of its collapse (its connection to the metadata service breaks) while every replica of
//! the tracking shard is SIGKILLed (the service's links to them break and nobody can decide).
//! The shards restart on their data directories and nobody asks again: the metadata service
//! must finish the collapse on its own. A new `collapse` call then learns the decided outcome,
//! and exactly one of parent and child is left, with no objects of the other.

mod common;

use std::time::{Duration, Instant};

use common::*;

const STATE_TIMEOUT: Duration = Duration::from_secs(60);

fn volumes(up: &Up) -> Vec<serde_json::Value> {
    serde_json::from_str::<serde_json::Value>(&up.ok(&["volume", "list", "--json"])).unwrap().as_array().unwrap().clone()
}

#[test]
fn a_collapse_whose_caller_and_tracking_shards_die_midway_completes_on_its_own() {
    // Three shards, three replicas: every shard holds the tracking object.
    // `up` would restart the killed shards itself: this test restarts them.
    let mut up = Up::start_with(3, &["--restart-after-ms", "0"]);
    up.ok(&["volume", "create", "db", "--size", "8M"]);
    up.ok(&["volume", "super", "db", "--child", "db.s1"]);
    let shards: Vec<(u32, String, String)> = (1..=3)
        .map(|id| {
            let s = up.shard(id);
            (id, s["addr"].as_str().unwrap().to_string(), s["dir"].as_str().unwrap().to_string())
        })
        .collect();
    for (id, _, _) in &shards {
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe { libc::kill(up.shard_pid(*id) as i32, libc::SIGKILL) };
    }

    // A caller asks for the collapse and dies before any shard can answer.
    let cluster = up.cluster_file().to_string_lossy().into_owned();
    let log = up.dir.path().join("collapse-caller.log");
    let caller = up.spawn(&["volume", "collapse", "db.s1", "--cluster", &cluster], &log);
    std::thread::sleep(Duration::from_millis(1500));
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!said.contains("promoted") && !said.contains("rejected"), "decided with every shard dead? {said}");
    up.kill_extra(caller);

    // The shards come back on their data directories; nobody asks again.
    let (meta, secret) = (up.meta_addr(), up.secret_file().to_string_lossy().into_owned());
    for (id, addr, dir) in &shards {
        let log = up.dir.path().join(format!("shard-{id}-restarted.log"));
        up.spawn(&["shard", "--id", &id.to_string(), "--dir", dir, "--listen", addr, "--meta", &meta, "--secret-file", &secret], &log);
    }
    // The metadata service decides and records the collapse on its own: the parent stayed
    // silent, so the child is promoted; its garbage collection ends the copy-on-write.
    let deadline = Instant::now() + STATE_TIMEOUT;
    loop {
        let vs = volumes(&up);
        let names: Vec<&str> = vs.iter().map(|v| v["name"].as_str().unwrap()).collect();
        if names == ["db.s1"] && vs[0]["super_parent"].is_null() && vs[0]["vol"]["parent"].is_null() {
            break;
        }
        assert!(Instant::now() < deadline, "the collapse was not finished by the service within {STATE_TIMEOUT:?}: {vs:#?}");
        std::thread::sleep(Duration::from_millis(200));
    }

    // A caller that asks again learns the outcome (not "not a super child").
    assert_eq!(up.ok(&["volume", "collapse", "db.s1"]).trim(), "promoted");
    // The parent is gone for good, and a volume that never was a child still gets an error.
    assert!(up.fails(&["volume", "info", "db"]).contains("no volume named"));
    up.ok(&["volume", "create", "other", "--size", "1M"]);
    assert!(up.fails(&["volume", "collapse", "other"]).contains("not a super child"));

    // The promoted child serves I/O once the shards are up again.
    for (id, _, _) in &shards {
        up.wait_shard(*id, "Up", STATE_TIMEOUT);
    }
    require_qemu();
    qemu_ok(&up.uri("db.s1"), &["write -P 0x41 0 64k", "read -P 0x41 0 64k"]);
}
