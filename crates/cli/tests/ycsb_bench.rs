//! `understudy bench ycsb redis --quick` completes against a real redis-server it starts, and
//! its last stdout line is well-formed BENCH.md JSON with the figures it promises (no timing is
//! asserted). Bad arguments get a clear error.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_understudy");

#[test]
fn quick_redis_bench_prints_bench_md_json() {
    let dir = tempfile::Builder::new().prefix("understudy-ycsb-test-").tempdir().unwrap();
    let out = dir.path().join("out");
    let o = Command::new(BIN)
        .args(["bench", "ycsb", "redis", "--workload", "a", "--clients", "4", "--quick", "--out"])
        .arg(&out)
        .current_dir(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}", o.status);
    let last = stdout.lines().last().expect("some stdout");
    let json: serde_json::Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {last}"));
    assert_eq!(json["bench"], "ycsb.redis");
    assert_eq!(json["quick"], true);
    let figures = json["figures"].as_object().unwrap();
    for name in [
        "redis.a.c4.load.throughput_ops_per_s",
        "redis.a.c4.load.insert.latency_us_p99",
        "redis.a.c4.run.throughput_ops_per_s",
        "redis.a.c4.run.read.latency_us_p50",
        "redis.a.c4.run.read.latency_us_p99",
        "redis.a.c4.run.update.latency_us_p999",
        "redis.a.c4.run.window.throughput_ops_per_s_p50",
    ] {
        let v = figures.get(name).unwrap_or_else(|| panic!("{name} missing: {last}"));
        assert!(v.as_f64().unwrap() > 0.0, "{name} = {v}");
    }
    assert_eq!(figures["redis.a.c4.load.ops_count"], 5000.0);
    for checks in ["missing_count", "corrupt_count", "errors_count"] {
        assert_eq!(figures[&format!("redis.a.c4.run.{checks}")], 0.0, "{checks}");
    }
    for file in ["redis-a-c4-throughput.csv", "redis-a-c4-latency-cdf.csv", "redis-a-c4-latency-cdf.png"] {
        assert!(out.join(file).is_file(), "{file} not written");
    }
    // The private redis-server is gone with its directory.
    let left = std::fs::read_dir(dir.path().join("target/bench-redis")).unwrap().count();
    assert_eq!(left, 0, "the redis data directory was not removed");
}

#[test]
fn bad_arguments_get_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    for (args, expect) in [
        (vec!["--workload", "z"], "unknown YCSB workload"),
        (vec!["--clients", "0"], "--clients must be at least 1"),
        (vec!["--distribution", "hotspot"], "unknown request distribution"),
        (vec!["--theta", "0"], "theta"),
        (vec!["--field-length", "1"], "checked on read"),
    ] {
        let o = Command::new(BIN)
            .args(["bench", "ycsb", "redis", "--quick"])
            .args(&args)
            .current_dir(dir.path())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(expect), "{args:?}: expected {expect:?} in {stderr}");
    }
}
