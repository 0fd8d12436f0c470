//! `understudy bench failover scenarios --quick` completes and emits well-formed JSON with the
//! issue's ratio names (no timing is asserted). Needs root, /dev/fuse, losetup, python3; set
//! UNDERSTUDY_SKIP_FUSE_TESTS=1 on a machine without them.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::BIN;

/// The quick run takes about 1.5 minutes on a loaded 2-core machine.
const BENCH_TIMEOUT: Duration = Duration::from_secs(600);

#[test]
fn quick_scenarios_bench_emits_the_ratios() {
    if std::env::var_os("UNDERSTUDY_SKIP_FUSE_TESTS").is_some() {
        eprintln!("skipped: UNDERSTUDY_SKIP_FUSE_TESTS is set");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut c = Command::new(BIN)
        .args(["bench", "failover", "scenarios", "--quick", "--out"])
        .arg(dir.path().join("out"))
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Bounded: a bench that hangs fails the test (and is stopped: it cleans up on SIGTERM).
    let (mut out, mut err) = (c.stdout.take().unwrap(), c.stderr.take().unwrap());
    let out = std::thread::spawn(move || {
        let mut v = vec![];
        let _ = out.read_to_end(&mut v);
        v
    });
    let err = std::thread::spawn(move || {
        let mut v = vec![];
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + BENCH_TIMEOUT;
    let status = loop {
        if let Some(s) = c.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            common::stop_child(&mut c, Duration::from_secs(60));
            panic!("the quick scenarios bench did not finish within {BENCH_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let o = std::process::Output { status, stdout: out.join().unwrap(), stderr: err.join().unwrap() };
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "bench failed: {}\n{stdout}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).expect("last line is JSON");
    assert_eq!(v["bench"], "failover.scenarios");
    for r in ["speculative_vs_oracle.failover_latency.worst", "reds_60s_vs_speculative.failover_latency", "super_vs_plain.app_recovery_latency"] {
        assert!(v["ratios"][r].as_f64().is_some_and(|x| x.is_finite() && x > 0.0), "ratio {r} missing or not positive: {v}");
    }
    assert!(v["figures"]["monitor.rss_peak_bytes"].as_f64().is_some_and(|x| x > 0.0), "{v}");
    // The interleaved recovery rounds behind super_vs_plain, and where a recovery went.
    assert_eq!(v["figures"]["recovery_rounds.rounds_count"].as_f64(), Some(2.0), "{v}");
    for kind in ["plain", "super"] {
        let f = &v["figures"][format!("recovery_rounds.{kind}.ext4_mount_ms_p50")];
        assert!(f.as_f64().is_some_and(|x| x.is_finite() && x >= 0.0), "{kind} breakdown missing: {v}");
    }
    // The shards' counters traced over those recoveries, the tables' sizes at open, and the
    // §6.5 windows run side by side.
    for f in ["recovery_rounds.super.shards.recovery.cow_first_writes_count_p50", "recovery_rounds.plain.shards.app_open.reads_count_p50", "recovery_rounds.plain.table_rows_count_p50"] {
        assert!(v["figures"][f].as_f64().is_some_and(|x| x.is_finite() && x >= 0.0), "{f} missing: {v}");
    }
    assert_eq!(v["figures"]["after_promotion.rounds_count"].as_f64(), Some(4.0), "{v}");
    assert!(v["figures"]["speculative.extra_instance_time_per_failure_s_mean"].as_f64().is_some_and(|x| x > 0.0), "{v}");
    // Speculative on the general clone (composed) in every scenario, with the twin's two
    // recoveries of one crashed volume it is composed from.
    for s in ["i_timeout_medium_long_recovery", "ii_timeout_medium_short_recovery", "iii_timeout_short_long_recovery", "iv_timeout_short_false_positive", "v_timeout_short_short_recovery"] {
        let r = format!("speculative_general_vs_speculative.failover_latency.scenario_{s}");
        assert!(v["ratios"][&r].as_f64().is_some_and(|x| x.is_finite() && x > 0.0), "ratio {r} missing: {v}");
        for kind in ["general", "super"] {
            let f = format!("scenario_{s}.general_twin.{kind}.backup_start_to_healthy_ms");
            assert!(v["figures"][&f].as_f64().is_some_and(|x| x.is_finite() && x > 0.0), "{f} missing: {v}");
        }
    }
    assert!(dir.path().join("out/throughput.csv").exists());
}
