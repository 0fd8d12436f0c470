//! `understudy bench kv recovery --quick` completes and emits well-formed JSON with the issue's
//! ratio names, from one run of HEAL, full copy and reactive log on the same store, load and EFN
//! (no timing is asserted: the figures are the bench's to report).

mod common;

#[test]
fn quick_recovery_bench_emits_the_three_scheme_ratios() {
    let dir = tempfile::tempdir().unwrap();
    let v = common::run_bench(
        dir.path(),
        &[
            "bench", "kv", "recovery", "--quick", "--nodes", "3", "--efn-s", "1", "--clients", "4", "--warmup-s", "1",
            "--baseline-window-s", "1",
        ],
    );
    assert_eq!(v["bench"], "kv.recovery");
    for r in [
        "fullcopy_vs_heal.recovery_latency",
        "reactive_vs_heal.recovery_latency",
        "memory.rss_vs_stored_plus_cap",
    ] {
        assert!(v["ratios"][r].as_f64().is_some_and(|x| x.is_finite() && x >= 0.0), "ratio {r} missing: {v}");
    }
    // Lost work is not clipped at zero (a window above the failure-free rate counts against
    // the loss), so the ratio need only be a number.
    let r = "heal_vs_fullcopy.throughput_lost";
    assert!(v["ratios"][r].as_f64().is_some_and(|x| x.is_finite()), "ratio {r} missing: {v}");
    for s in ["heal", "fullcopy", "reactive"] {
        let f = &v["figures"][format!("{s}.recovery_latency_ms")];
        assert!(f.as_f64().is_some_and(|x| x > 0.0), "{s}: {v}");
    }
    // Each scheme's loss is measured against failure-free windows of its own run, per round.
    for s in ["heal", "fullcopy", "reactive"] {
        for f in ["throughput_failure_free_ops_per_s", "throughput_efn_tail_ops_per_s", "round1.load_average_1m_ratio", "loss_span_s"] {
            assert!(v["figures"][format!("{s}.{f}")].as_f64().is_some_and(|x| x.is_finite() && x >= 0.0), "{s}.{f}: {v}");
        }
        for f in ["throughput_lost_s", "failure_throughput_lost_s", "round1.throughput_lost_s", "recovery_throughput_lost_s", "round1.recovery_throughput_lost_s"] {
            assert!(v["figures"][format!("{s}.{f}")].as_f64().is_some_and(|x| x.is_finite()), "{s}.{f}: {v}");
        }
    }
    // The load is YCSB-B's: zipfian 0.99, 5% updates.
    assert_eq!(v["figures"]["load.zipfian_theta_ratio"], 0.99, "{v}");
    assert_eq!(v["figures"]["load.write_percent"], 5.0, "{v}");
    assert_eq!(v["figures"]["load.loss_window_ms"], 10.0, "{v}");
    // The full copy really copied the store; HEAL and the reactive log did not.
    assert_eq!(v["figures"]["fullcopy.fell_back_to_full_copy_ratio"], 1.0, "{v}");
    assert_eq!(v["figures"]["heal.fell_back_to_full_copy_ratio"], 0.0, "{v}");
    assert_eq!(v["figures"]["reactive.fell_back_to_full_copy_ratio"], 0.0, "{v}");
    // The baselines make durable everything they receive (the full copy's new node the whole
    // store, the reactive log every redundant update): their logs take at least the bytes of
    // the entries received (a record is an entry plus its framing).
    for s in ["fullcopy", "reactive"] {
        let received = v["figures"][format!("{s}.recovery_bytes")].as_f64().unwrap();
        let logged = v["figures"][format!("{s}.recovery_log_durable_bytes")].as_f64().unwrap();
        assert!(received > 0.0 && logged >= received, "{s}: {logged} logged of {received} received: {v}");
    }
    assert!(dir.path().join("out/recovery_throughput.csv").exists());
    assert!(dir.path().join("out/recovery_throughput.svg").exists());
}

#[test]
fn a_store_larger_than_the_memory_is_refused_before_any_work() {
    // Run in a directory of its own and killed after a while: without the check the bench
    // would start writing a preload image of that size (under `target/` of its directory).
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_understudy"))
        .args(["bench", "kv", "recovery", "--keys", "100000000000", "--out", "out"])
        .current_dir(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("the bench did not refuse the store: it was still running");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(!status.success());
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(err.contains("GiB of memory") && err.contains("pass --keys"), "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing written");
}
