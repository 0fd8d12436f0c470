//! `understudy up` on free ports, a volume written and read with qemu-io over NBD, qemu-img
//! info, super/collapse promoted (a fenced parent write fails) and rejected, a general clone,
//! resize and delete — all through the built binary.

mod common;

use std::time::{Duration, Instant};

use common::*;

fn wait_gc_done(up: &Up, volume: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v: serde_json::Value = serde_json::from_str(&up.ok(&["volume", "info", volume, "--json"])).unwrap();
        let jobs: serde_json::Value = serde_json::from_str(&up.ok(&["status", "--json"])).unwrap();
        if v["vol"]["parent"].is_null() && jobs["jobs"].as_array().unwrap().is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "garbage collection of {volume} did not finish: {v} {jobs}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn volume_io_super_collapse_both_ways() {
    require_qemu();
    let mut up = Up::start(4);
    assert!(up.up_output().contains("nbd://"), "up prints the NBD endpoint:\n{}", up.up_output());
    let mode = std::fs::metadata(up.secret_file()).unwrap();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777, 0o600, "secret file is private");

    // Create, list, info; write and read patterns with a real client.
    let out = up.ok(&["volume", "create", "vol", "--size", "64M"]);
    assert!(out.contains("created vol"), "{out}");
    assert!(up.ok(&["volume", "list"]).contains("vol"));
    let uri = up.uri("vol");
    qemu_ok(&uri, &["write -P 0x5a 0 1M", "write -P 0x5b 1M 64k", "read -P 0x5a 0 1M", "read -P 0x5b 1M 64k", "read -P 0 2M 64k"]);
    // The same volume over the NBD server's Unix socket.
    let sock = up.info["nbd"]["unix_socket"].as_str().unwrap().to_string();
    qemu_ok(&format!("nbd+unix:///vol?socket={sock}"), &["read -P 0x5a 0 1M"]);
    let info = std::process::Command::new("qemu-img").args(["info", "--output=json", &uri]).output().unwrap();
    assert!(info.status.success(), "qemu-img info: {}", String::from_utf8_lossy(&info.stderr));
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["virtual-size"], 64u64 << 20, "qemu-img info: {info}");

    // Round 1: the parent stays silent -> promoted.
    let mut parent = QemuSession::open(&uri);
    let child = up.ok(&["volume", "super", "vol"]).trim().to_string();
    assert_eq!(child, "vol.super-1");
    let curi = up.uri(&child);
    qemu_ok(&curi, &["read -P 0x5a 0 64k", "write -P 0xc1 4k 4k", "write -P 0xc2 128k 64k"]);
    assert_eq!(up.ok(&["volume", "collapse", &child]).trim(), "promoted");
    qemu_ok(
        &curi,
        &[
            "read -P 0x5a 0 4k",
            "read -P 0xc1 4k 4k",
            "read -P 0x5a 8k 120k",
            "read -P 0xc2 128k 64k",
            "read -P 0x5a 192k 832k",
            "read -P 0x5b 1M 64k",
        ],
    );
    let (ok, text) = parent.cmd("write -P 0xee 0 4k");
    assert!(!ok && (text.contains("Operation not permitted") || text.contains("Input/output error")), "fenced parent write: {text}");
    drop(parent);
    let (ok, text) = qemu_io(&uri, &["read 0 4k"]);
    assert!(!ok, "the collapsed-away parent is no longer exported: {text}");
    assert!(!up.ok(&["volume", "list"]).lines().any(|l| l.starts_with("vol ")));
    wait_gc_done(&up, &child);

    // Round 2: the parent keeps writing -> rejected; the parent keeps its writes.
    let mut parent = QemuSession::open(&curi);
    assert_eq!(up.ok(&["volume", "super", &child, "--child", "rec2"]).trim(), "rec2");
    qemu_ok(&up.uri("rec2"), &["write -P 0xd1 0 64k"]);
    let (ok, text) = parent.cmd("write -P 0x77 2M 4k");
    assert!(ok, "a parent write after super succeeds: {text}");
    assert_eq!(up.ok(&["volume", "collapse", "rec2"]).trim(), "rejected");
    for c in ["read -P 0x77 2M 4k", "read -P 0x5a 0 4k", "read -P 0xc1 4k 4k", "write -P 0x78 3M 4k", "read -P 0x78 3M 4k"] {
        let (ok, text) = parent.cmd(c);
        assert!(ok, "parent `{c}` after a rejected collapse: {text}");
    }
    drop(parent);
    assert!(!up.ok(&["volume", "list"]).contains("rec2"));
    wait_gc_done(&up, &child);

    // The rbd-style baseline clone reads through to its parent and copies up on write.
    assert_eq!(up.ok(&["volume", "clone-general", &child, "gclone"]).trim(), "gclone");
    qemu_ok(
        &up.uri("gclone"),
        &["read -P 0x5a 0 4k", "write -P 0x99 0 4k", "read -P 0x99 0 4k", "read -P 0xc1 4k 4k", "read -P 0x5a 8k 56k"],
    );
    qemu_ok(&curi, &["read -P 0x5a 0 4k"]);

    // Resize and delete.
    up.ok(&["volume", "resize", &child, "--size", "128M"]);
    let info = std::process::Command::new("qemu-img").args(["info", "--output=json", &curi]).output().unwrap();
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["virtual-size"], 128u64 << 20);
    up.ok(&["volume", "delete", "gclone"]);
    up.ok(&["volume", "create", "scratch", "--size", "1M", "--object-size", "4K"]);
    up.ok(&["volume", "delete", "scratch"]);
    let list = up.ok(&["volume", "list"]);
    assert!(!list.contains("gclone") && !list.contains("scratch"), "{list}");
    let status = up.ok(&["status"]);
    assert!(status.contains("4/4 shards up"), "{status}");

    // `up` again on the same directory: same secret, same volumes, same data.
    let secret = std::fs::read(up.secret_file()).unwrap();
    up.restart();
    assert_eq!(std::fs::read(up.secret_file()).unwrap(), secret);
    qemu_ok(&up.uri(&child), &["read -P 0x5a 0 4k", "read -P 0xc1 4k 4k", "read -P 0x77 2M 4k", "read -P 0x78 3M 4k"]);
    assert!(up.ok(&["volume", "list"]).contains(&child));
}
