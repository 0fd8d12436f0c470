//! Bad input gets one clear line on stderr and a non-zero exit code, and changes nothing.

mod common;

use std::process::{Command, Stdio};

use common::*;

#[test]
fn bad_input_gets_clear_errors() {
    require_qemu();
    let up = Up::start(3);
    up.ok(&["volume", "create", "vol", "--size", "8M"]);

    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["volume", "info", "nope"], "no volume named \"nope\""),
        (vec!["volume", "delete", "nope"], "no volume named \"nope\""),
        (vec!["volume", "super", "nope"], "no volume named \"nope\""),
        (vec!["volume", "collapse", "nope"], "no volume named \"nope\""),
        (vec!["volume", "collapse", "vol"], "not a super child"),
        (vec!["volume", "create", "huge", "--size", "100P"], "larger than the largest volume"),
        (vec!["volume", "create", "odd", "--size", "1000"], "multiple of 512"),
        (vec!["volume", "create", "obj", "--size", "1M", "--object-size", "3K"], "power of two"),
        (vec!["volume", "create", "vol", "--size", "1M"], "already exists"),
        (vec!["volume", "create", "bad/name", "--size", "1M"], "volume names are"),
        (vec!["volume", "resize", "vol", "--size", "4M"], "shrinking"),
        (vec!["volume", "super", "vol", "--child", "vol"], "already exists"),
        (vec!["volume", "clone-general", "nope", "c"], "no volume named \"nope\""),
        (vec!["volume", "detach", "/nonexistent-mount-dir"], "nothing is attached"),
    ];
    for (args, expect) in &cases {
        let err = up.fails(args);
        assert!(err.contains(expect), "`understudy {}`: expected {expect:?} in {err:?}", args.join(" "));
    }
    // Refused before any cluster or Ceph daemon starts (Ceph need not be installed).
    for replicas in ["0", "5"] {
        let o = Command::new(BIN).args(["bench", "volume", "ceph", "--replicas", replicas]).stdin(Stdio::null()).output().unwrap();
        let err = expect_one_line_error(&o, "bench volume ceph --replicas");
        assert!(err.contains("--replicas must be between 1 and --shards (4)"), "{err}");
    }
    // Unparsable sizes are refused by the argument parser, with the reason.
    let o = up.cli(&["volume", "create", "x", "--size", "12Q"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("is not a size"));

    // Nothing changed: one volume, untouched.
    let list = up.ok(&["volume", "list", "--json"]);
    let vols: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(vols.as_array().unwrap().len(), 1, "{list}");
    assert_eq!(vols[0]["size_bytes"], 8u64 << 20);

    // super and general clones do not mix: a promoting collapse would retire the clone's parent.
    up.ok(&["volume", "clone-general", "vol", "gclone"]);
    let err = up.fails(&["volume", "super", "vol"]);
    assert!(err.contains("has general clones"), "{err}");
    up.ok(&["volume", "delete", "gclone"]);
    up.ok(&["volume", "super", "vol", "--child", "vchild"]);
    let err = up.fails(&["volume", "clone-general", "vol", "gclone2"]);
    assert!(err.contains("has a super child"), "{err}");
    let err = up.fails(&["volume", "super", "vol"]);
    assert!(err.contains("already has a super child"), "{err}");
    let err = up.fails(&["volume", "delete", "vol"]);
    assert!(err.contains("has a super child"), "{err}");
    assert_eq!(up.ok(&["volume", "collapse", "vchild"]).trim(), "promoted");

    // An unknown export over NBD.
    let (ok, text) = qemu_io(&up.uri("nope"), &["read 0 4k"]);
    assert!(!ok, "{text}");

    // A wrong secret is refused, and said so.
    let wrong = up.dir.path().join("wrong-secret");
    std::fs::write(&wrong, "not-the-secret\n").unwrap();
    std::fs::set_permissions(&wrong, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let o = Command::new(BIN).args(["status", "--cluster"]).arg(up.cluster_file()).arg("--secret-file").arg(&wrong).output().unwrap();
    let err = expect_one_line_error(&o, "status with a wrong secret");
    assert!(err.contains("secret"), "{err}");

    // A shard pointed at a missing data directory refuses to start, and says how to create one.
    let o = Command::new(BIN)
        .args(["shard", "--id", "9", "--dir", "/nonexistent/understudy-shard", "--listen", "127.0.0.1:0", "--meta"])
        .arg(up.meta_addr())
        .arg("--secret-file")
        .arg(up.secret_file())
        .output()
        .unwrap();
    // (A daemon logs its start first: the error is its last line.)
    let stderr = String::from_utf8_lossy(&o.stderr);
    let err = stderr.trim_end().lines().last().unwrap_or_default();
    assert!(!o.status.success() && err.starts_with("error: ") && err.contains("does not exist") && err.contains("--create"), "{stderr}");

    // No cluster file; nothing listening.
    let o = Command::new(BIN).args(["status", "--cluster", "/nonexistent/cluster.json"]).output().unwrap();
    let err = expect_one_line_error(&o, "status without a cluster");
    assert!(err.contains("cannot read cluster file"), "{err}");
    let o = Command::new(BIN).args(["volume", "list", "--meta", "127.0.0.1:1", "--secret-file"]).arg(up.secret_file()).output().unwrap();
    let err = expect_one_line_error(&o, "list with no metadata service");
    assert!(err.contains("127.0.0.1:1"), "{err}");

    // `up` on ports already taken fails at once with a clear error.
    let port = up.meta_addr().rsplit_once(':').unwrap().1.to_string();
    let other = tempfile::tempdir().unwrap();
    let o = Command::new(BIN)
        .args(["up", "--dir"])
        .arg(other.path())
        .args(["--port-base", &port, "--shards", "1", "--replicas", "1"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = expect_one_line_error(&o, "up on a taken port");
    assert!(err.contains("already in use"), "{err}");
    // A daemon that cannot start: `up` says which and why, in one line.
    let broken = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(broken.path().join("meta")).unwrap();
    std::fs::write(broken.path().join("meta/meta.json"), "{ not json").unwrap();
    let o = Command::new(BIN)
        .args(["up", "--dir"])
        .arg(broken.path())
        .args(["--port-base", "0", "--shards", "1", "--replicas", "1"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = expect_one_line_error(&o, "up with a corrupt metadata file");
    assert!(err.contains("metadata service exited during start-up") && err.contains("corrupt"), "{err}");
    // And a second `up` on the same directory is refused.
    let o = Command::new(BIN).args(["up", "--dir"]).arg(up.dir.path()).args(["--port-base", "0"]).stdin(Stdio::null()).output().unwrap();
    let err = expect_one_line_error(&o, "second up on one directory");
    assert!(err.contains("already running"), "{err}");
}
