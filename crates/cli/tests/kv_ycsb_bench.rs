//! `understudy bench kv ycsb --quick` completes against a local HEAL group (real processes),
//! with a node killed and restarted mid-run, and its last stdout line is well-formed BENCH.md
//! JSON with the figures it promises (no timing is asserted). Bad arguments get clear errors.

mod common;

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_understudy");

fn json_of(stdout: &str) -> serde_json::Value {
    let last = stdout.lines().last().expect("some stdout");
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {last}"))
}

#[test]
fn quick_ycsb_with_a_kill_prints_bench_md_json() {
    let dir = tempfile::Builder::new()
        .prefix("understudy-kv-ycsb-test-")
        .tempdir()
        .unwrap();
    let out = dir.path().join("out");
    let o = Command::new(BIN)
        .args([
            "bench",
            "kv",
            "ycsb",
            "--workload",
            "b",
            "--clients",
            "4",
            "--records",
            "300",
        ])
        .args([
            "--operations",
            "1000000",
            "--duration-s",
            "8",
            "--kill-at-s",
            "2",
            "--down-s",
            "1",
            "--quick",
            "--out",
        ])
        .arg(&out)
        .current_dir(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        o.status
    );
    let json = json_of(&stdout);
    assert_eq!(json["bench"], "kv.ycsb");
    assert_eq!(json["quick"], true);
    let figures = json["figures"].as_object().unwrap();
    for name in [
        "heal.b.c4.load.throughput_ops_per_s",
        "heal.b.c4.load.insert.latency_us_p99",
        "heal.b.c4.run.throughput_ops_per_s",
        "heal.b.c4.run.read.latency_us_p50",
        "heal.b.c4.run.read.latency_us_p99",
        "heal.b.c4.run.update.latency_us_p999",
        "kill.restart_to_serving_ms",
        "kill.at_s",
        // From the restarted node's `recovered` event (written before it can serve again).
        "kill.heal.recovery_latency_ms",
    ] {
        let v = figures
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing: {json}"));
        assert!(v.as_f64().unwrap() > 0.0, "{name} = {v}");
    }
    // Present, but may be zero: the failure stalls writes, and closed-loop clients with them,
    // for a good part of this short run.
    for name in [
        "heal.b.c4.run.window.throughput_ops_per_s_p50",
        "kill.down.throughput_ops_per_s",
    ] {
        let v = figures
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing: {json}"));
        assert!(v.as_f64().unwrap() >= 0.0, "{name} = {v}");
    }
    assert_eq!(figures["heal.b.c4.load.ops_count"], 300.0);
    // Every value read back was one the driver wrote, and no acknowledged record was lost.
    for checks in ["missing_count", "corrupt_count"] {
        assert_eq!(figures[&format!("heal.b.c4.run.{checks}")], 0.0, "{checks}");
    }
    for file in [
        "heal-b-c4-throughput.csv",
        "heal-b-c4-throughput.png",
        "heal-b-c4-latency-cdf.csv",
    ] {
        assert!(out.join(file).is_file(), "{file} not written");
    }
    // The group's directory is gone.
    common::assert_no_cluster_left(dir.path());
}

#[test]
fn bad_arguments_get_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    for (args, expect) in [
        (vec!["ycsb", "--workload", "e"], "keeps no key order"),
        (vec!["ycsb", "--workload", "z"], "unknown YCSB workload"),
        (
            vec!["ycsb", "--clients", "0"],
            "--clients must be at least 1",
        ),
        (
            vec!["ycsb", "--kill-at-s", "9", "--duration-s", "5"],
            "must outlast the kill",
        ),
        (
            vec!["zookeeper", "--write-rate", "0"],
            "--write-rate must be",
        ),
        (
            vec!["zookeeper", "--value-bytes", "2"],
            "--value-bytes must be",
        ),
    ] {
        let o = Command::new(BIN)
            .args(["bench", "kv"])
            .args(&args)
            .arg("--quick")
            .current_dir(dir.path())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(
            stderr.contains(expect),
            "{args:?}: expected {expect:?} in {stderr}"
        );
    }
}
