//! `understudy bench kv zookeeper --quick` completes: a real 3-server ZooKeeper ensemble
//! (Debian's `zookeeper`, installed by scripts/install-deps) and a local HEAL group each lose a
//! replica for the same EFN under the same write rate, and the last stdout line is well-formed
//! BENCH.md JSON with both catch-up times and their ratio (no timing is asserted).

mod common;

use std::process::Command;

#[test]
fn quick_zookeeper_comparison_prints_bench_md_json() {
    if !std::path::Path::new("/usr/share/java/zookeeper.jar").exists() {
        eprintln!("skipped: ZooKeeper is not installed (apt-get install zookeeper)");
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("understudy-kv-zk-test-")
        .tempdir()
        .unwrap();
    let out = dir.path().join("out");
    let o = Command::new(env!("CARGO_BIN_EXE_understudy"))
        .args([
            "bench",
            "kv",
            "zookeeper",
            "--quick",
            "--efn-s",
            "2",
            "--warmup-s",
            "1",
            "--write-rate",
            "50",
        ])
        .args(["--keys", "100", "--out"])
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
    let last = stdout.lines().last().expect("some stdout");
    let json: serde_json::Value =
        serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {last}"));
    assert_eq!(json["bench"], "kv.zookeeper");
    let figures = json["figures"].as_object().unwrap();
    for name in [
        "zookeeper.catchup_latency_ms",
        "zookeeper.listen_to_catchup_ms",
        "zookeeper.write.latency_us_p50",
        "heal.catchup_latency_ms",
        "heal.write.latency_us_p50",
        "heal.write_throughput_ops_per_s",
        "zookeeper.write_throughput_ops_per_s",
    ] {
        let v = figures
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing: {last}"));
        assert!(v.as_f64().unwrap() > 0.0, "{name} = {v}");
    }
    let ratio = json["ratios"]["zookeeper_vs_heal.recovery_latency"]
        .as_f64()
        .expect("the ratio");
    assert!(ratio > 0.0);
    for file in [
        "zookeeper_vs_heal_throughput.csv",
        "zookeeper_vs_heal_throughput.png",
        "zookeeper_vs_heal_catchup.png",
    ] {
        assert!(out.join(file).is_file(), "{file} not written");
    }
    common::assert_no_cluster_left(dir.path());
}
