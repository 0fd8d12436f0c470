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
    let v = common::run_bench(dir.path(), &["bench", "nearlog", "apps", "--quick", "--secs", "0.5", "--shim", so]);
    assert_eq!(v["bench"], "nearlog.apps");
    for r in [
        "nearlog_vs_strong.redis.c1.throughput",
        "nearlog_vs_strong.redis.c8.throughput",
        "nearlog_vs_weak.redis.c50.throughput",
        "nearlog_vs_strong.sqlite.c1.throughput",
        "nearlog_vs_loopback_rtt.write_fsync.latency_p50",
        "nearlog_vs_loopback_rtt_c.write_fsync_c.latency_p50",
        "nearlog_vs_strong.rocksdb.c1.throughput",
    ] {
        assert!(v["ratios"][r].as_f64().is_some_and(|x| x.is_finite() && x > 0.0), "ratio {r} missing or not positive: {v}");
    }
    for f in ["peer.peak_rss_bytes", "peer.region_bytes", "shim.write_fsync.rss_overhead_bytes"] {
        assert!(v["figures"][f].as_f64().is_some_and(f64::is_finite), "figure {f} missing: {v}");
    }
    assert!(dir.path().join("out/apps.csv").exists());
    assert!(dir.path().join("out/redis-latency-vs-throughput-local.svg").exists());
}
