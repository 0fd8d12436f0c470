//! `understudy bench control failover` in its tiny variant (one leader kind, the nearlog
//! controller; one repetition) completes and emits well-formed JSON: the figures and the ratio
//! of the part measured under the names, nothing of the parts not asked for, and the
//! failover monitor's ratio absent (not measured yet). No timing is asserted. Needs root
//! (network namespaces) and etcd-server, as the other host-bed tests.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::BIN;

/// The tiny run took 5 s on a loaded 2-core machine (load 18); the bound is far above it.
const BENCH_TIMEOUT: Duration = Duration::from_secs(300);

/// Runs the CLI, bounded; its output and its pid.
fn run(args: &[&str], cwd: &std::path::Path) -> (std::process::Output, u32) {
    let mut c = Command::new(BIN).args(args).current_dir(cwd).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = c.id();
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
            common::stop_child(&mut c, Duration::from_secs(30));
            panic!("the bench did not finish within {BENCH_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    (std::process::Output { status, stdout: out.join().unwrap(), stderr: err.join().unwrap() }, pid)
}

#[test]
fn tiny_control_failover_bench_emits_the_takeover_ratio() {
    if let Err(e) = testbed::hosts::available() {
        eprintln!("skipped: network namespaces are not available here: {e:#}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("out");
    let (o, pid) = run(
        &["bench", "control", "failover", "--quick", "--reps", "1", "--only", "nearlog-controller", "--out", out_dir.to_str().unwrap()],
        dir.path(),
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "bench failed: {}\n{stdout}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).expect("the last line is JSON");
    assert_eq!(v["bench"], "control.failover");
    assert_eq!(v["quick"], true);
    let figures = v["figures"].as_object().unwrap();
    assert_eq!(figures["lease_ttl_ms"].as_f64(), Some(2000.0), "{v}");
    let [p50, min, max] = ["p50", "min", "max"].map(|s| figures[&format!("takeover.nearlog_controller.decision_ms_{s}")].as_f64().unwrap());
    assert!(min > 0.0 && min <= p50 && p50 <= max, "{v}");
    let ratio = v["ratios"]["takeover_vs_lease_ttl.nearlog_controller"].as_f64().unwrap();
    assert!((ratio - p50 / 2000.0).abs() < 1e-9, "the ratio is the median over the TTL: {v}");
    // Only the part asked for: no other leader's figure (never one not measured in this run).
    let ratios = v["ratios"].as_object().unwrap();
    assert_eq!(ratios.len(), 1, "{v}");
    assert!(figures.keys().all(|k| k == "lease_ttl_ms" || k.starts_with("takeover.nearlog_controller.")), "{v}");
    // The raw samples: one row for the one repetition, with the load beside it.
    let csv = std::fs::read_to_string(out_dir.join("samples.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(rows[0], "part,rep,what,value,loadavg");
    assert_eq!(rows.len(), 2, "{csv}");
    assert!(rows[1].starts_with("nearlog_controller,0,decision_ms,"), "{csv}");
    // No host bed of this run is left behind (a bed's namespaces are named after its pid).
    let left = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let left = String::from_utf8_lossy(&left.stdout);
    assert!(!left.contains(&format!("ushb-{pid}-")), "namespaces left: {left}");
}

/// Bad options get a clear error before anything is started.
#[test]
fn control_failover_bench_refuses_a_short_ttl_and_zero_reps() {
    let dir = tempfile::tempdir().unwrap();
    let (o, _) = run(&["bench", "control", "failover", "--quick", "--election-ttl-ms", "500"], dir.path());
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("at least 1000"), "{}", String::from_utf8_lossy(&o.stderr));
    let (o, _) = run(&["bench", "control", "failover", "--quick", "--reps", "0"], dir.path());
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--reps must be at least 1"), "{}", String::from_utf8_lossy(&o.stderr));
}
