//! `understudy bench kv recovery --quick` completes and emits well-formed JSON with the issue's
//! ratio names, from one run of HEAL, full copy and reactive log on the same store, load and EFN
//! (no timing is asserted: the figures are the bench's to report).

use std::process::Command;

#[test]
fn quick_recovery_bench_emits_the_three_scheme_ratios() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_understudy"))
        .args(["bench", "kv", "recovery", "--quick", "--nodes", "3", "--efn-s", "1", "--clients", "4", "--out"])
        .arg(dir.path().join("out"))
        .current_dir(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "bench failed: {}\n{stdout}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).expect("last line is JSON");
    assert_eq!(v["bench"], "kv.recovery");
    for r in [
        "fullcopy_vs_heal.recovery_latency",
        "reactive_vs_heal.recovery_latency",
        "heal_vs_fullcopy.throughput_lost",
        "memory.rss_vs_stored_plus_cap",
    ] {
        assert!(v["ratios"][r].as_f64().is_some_and(|x| x.is_finite() && x >= 0.0), "ratio {r} missing: {v}");
    }
    for s in ["heal", "fullcopy", "reactive"] {
        let f = &v["figures"][format!("{s}.recovery_latency_ms")];
        assert!(f.as_f64().is_some_and(|x| x > 0.0), "{s}: {v}");
    }
    // The full copy really copied the store; HEAL and the reactive log did not.
    assert_eq!(v["figures"]["fullcopy.fell_back_to_full_copy_ratio"], 1.0, "{v}");
    assert_eq!(v["figures"]["heal.fell_back_to_full_copy_ratio"], 0.0, "{v}");
    assert_eq!(v["figures"]["reactive.fell_back_to_full_copy_ratio"], 0.0, "{v}");
    assert!(dir.path().join("out/recovery_throughput.csv").exists());
    assert!(dir.path().join("out/recovery_throughput.svg").exists());
}
