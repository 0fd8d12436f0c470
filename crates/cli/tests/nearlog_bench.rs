//! `understudy bench nearlog apps --quick` completes on an attached Understudy volume and emits
//! well-formed JSON with the ratio names (no timing is asserted; runs shortened with
//! --secs). Needs root, /dev/fuse, losetup, redis-server, python3, cc and librocksdb-dev; set
//! UNDERSTUDY_SKIP_FUSE_TESTS=1 on a machine without FUSE.

mod common;
mod nearlog_common;

#[test]
fn quick_apps_bench_emits_the_ratios() {
    if std::env::var_os("UNDERSTUDY_SKIP_FUSE_TESTS").is_some() {
        eprintln!("skipped: UNDERSTUDY_SKIP_FUSE_TESTS is set");
        return;
    }
    let so = nearlog_common::shim_path();
    let dir = tempfile::tempdir().unwrap();
    let so = so.to_str().expect("a UTF-8 path");
    let v = common::run_bench(dir.path(), &["bench", "nearlog", "apps", "--quick", "--secs", "0.5", "--redis-benchmark", "--shim", so]);
    assert_eq!(v["bench"], "nearlog.apps");
    // Nothing the bench started (Redis's AOF-rewrite child included) is left with its cwd on the
    // volume, and the volume's mount is gone.
    let root = dir.path().canonicalize().unwrap();
    let left: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| std::fs::read_link(e.path().join("cwd")).is_ok_and(|c| c.starts_with(&root)))
        .map(|e| format!("{:?}: {}", e.file_name(), std::fs::read_to_string(e.path().join("cmdline")).unwrap_or_default().replace('\0', " ")))
        .collect();
    assert!(left.is_empty(), "processes left with their cwd under {}: {left:?}", root.display());
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(!mounts.lines().any(|l| l.split_whitespace().nth(1).is_some_and(|m| m.starts_with(&*root.to_string_lossy()))), "a mount left under {}: {mounts}", root.display());
    for r in [
        "nearlog_vs_strong.redis.c1.throughput",
        "nearlog_vs_strong.redis.c8.throughput",
        "nearlog_vs_weak.redis.c50.throughput",
        "nearlog_vs_strong.sqlite.c1.throughput",
        "nearlog_vs_loopback_rtt.write_fsync.latency_p50",
        "nearlog_vs_strong.rocksdb.c1.throughput",
        "nearlog_vs_weak.redis_benchmark.c50.throughput",
    ] {
        assert!(v["ratios"][r].as_f64().is_some_and(|x| x.is_finite() && x > 0.0), "ratio {r} missing or not positive: {v}");
    }
    for f in ["peer.peak_rss_bytes", "peer.region_bytes", "shim.write_fsync.rss_overhead_bytes"] {
        assert!(v["figures"][f].as_f64().is_some_and(f64::is_finite), "figure {f} missing: {v}");
    }
    assert!(dir.path().join("out/apps.csv").exists());
    assert!(dir.path().join("out/redis-latency-vs-throughput-local.svg").exists());
}
