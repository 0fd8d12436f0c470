//! The recovery-trace benchmark (SpecREDS §6.2, Figure 4c/4d) end to end at a tiny size, against
//! an in-process cluster (metadata service + four shards on loopback): SQLite on ext4 on a
//! volume is SIGKILLed mid-load, its recovery is recorded, and the trace is replayed on plain,
//! super and general clone volumes. Checks that the trace has reads and writes, that the
//! recovery kept every acknowledged row with integrity_check ok, and that the report has every
//! figure; timings are not asserted.
//!
//! Needs root, /dev/fuse, free loop devices, mkfs.ext4, python3 (with sqlite3) and the sqlite3
//! CLI. Without root or /dev/fuse (or with UNDERSTUDY_SKIP_FUSE_TESTS set) it prints why and
//! passes without running.

use std::path::Path;
use std::sync::Arc;

use eval::volume::recovery_trace::{OpKind, TraceOptions, VARIANTS};
use volume::driver::client::Cluster;
use volume::driver::meta::{MetaReq, MetaResp};

const SECRET: &[u8] = b"test-secret";
const MIB: u64 = 1 << 20;

/// Why this machine cannot run the test, if it cannot.
fn skip_reason() -> Option<String> {
    if std::env::var_os("UNDERSTUDY_SKIP_FUSE_TESTS").is_some() {
        return Some("UNDERSTUDY_SKIP_FUSE_TESTS is set".into());
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not running as root (losetup and mount need it)".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("/dev/fuse is missing".into());
    }
    None
}

async fn start_cluster(dir: &Path) -> Arc<Cluster> {
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_test_writer().try_init();
    volume::testkit::start_in_process(dir, 4, SECRET).await.unwrap()
}

// Three worker threads: the FUSE session's I/O runs on the runtime while the test waits in
// spawn_blocking for attach, the load and the recovery.
#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn sqlite_recovery_trace_is_recorded_and_replayed() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping the recovery-trace test: {why}");
        return;
    }
    let dir = std::env::temp_dir().join(format!("understudy-trace-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cluster = start_cluster(&dir.join("cluster")).await;
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();

    let opts = TraceOptions {
        volume_size_bytes: 64 * MIB,
        db_checkpointed_bytes: MIB,
        wal_bytes: 2 * MIB,
        row_bytes: 1000,
        rows_per_txn: 16,
        replay_rounds: 1,
        work_dir: Some(dir.join("work")),
        ..TraceOptions::new(true)
    };
    let mut report = bench::Report::new("volume.recovery_trace", true);
    let recording = eval::volume::recovery_trace::run_with(cluster.clone(), &opts, &out, &mut report).await.unwrap();

    // The application's recovery was sound.
    assert_eq!(recording.integrity, "ok");
    assert!(recording.rows_acked_count > 0, "the load acknowledged no rows before the kill");
    assert!(
        recording.rows_recovered_count >= recording.rows_acked_count,
        "acknowledged rows lost: {} acked, {} recovered",
        recording.rows_acked_count,
        recording.rows_recovered_count
    );
    assert!(recording.wal_bytes >= 2 * MIB, "the WAL held {} bytes at the kill", recording.wal_bytes);
    // The trace holds the recovery's reads and writes.
    let trace = &recording.trace;
    assert!(trace.count(OpKind::Read) > 0 && trace.count(OpKind::Write) > 0, "reads {} writes {}", trace.count(OpKind::Read), trace.count(OpKind::Write));
    assert_eq!(trace.ops_dropped, 0);
    assert_eq!(trace.ops_failed, 0);
    let saved = eval::volume::recovery_trace::Trace::load_csv(&out.join("recovery_trace.csv")).unwrap();
    assert_eq!(saved.ops, trace.ops);

    // The report has every figure and ratio, with operation counts matching the trace.
    let json: serde_json::Value = serde_json::from_str(&report.to_json_line()).unwrap();
    let figures = &json["figures"];
    for variant in VARIANTS {
        for kind in ["read", "write"] {
            for stat in ["p50", "p90", "p99", "p999", "mean"] {
                let name = format!("{variant}.recovery_trace.{kind}.latency_us_{stat}");
                assert!(figures[&name].as_f64().is_some(), "{name} missing from {figures}");
            }
        }
        let reads = figures[&format!("{variant}.recovery_trace.read.ops_count")].as_f64().unwrap();
        assert_eq!(reads as usize, trace.count(OpKind::Read) * opts.replay_rounds);
    }
    for ratio in [
        "super_vs_plain.recovery_trace.write.latency",
        "general_vs_super.recovery_trace.write.latency",
        "super_vs_plain.recovery_trace.write.latency_p99",
        "general_vs_super.recovery_trace.write.latency_p99",
        "super_vs_plain.recovery_trace.read.latency",
    ] {
        assert!(json["ratios"][ratio].as_f64().is_some(), "{ratio} missing");
    }
    for file in ["fig4c_recovery_trace_read_cdf.png", "fig4d_recovery_trace_write_cdf.svg", "recovery_trace_replay.csv"] {
        assert!(out.join(file).is_file(), "{file} not written");
    }
    // Every volume the benchmark made is gone.
    match cluster.meta(MetaReq::List).await.unwrap() {
        MetaResp::Volumes(v) => assert!(v.is_empty(), "volumes left behind: {:?}", v.iter().map(|r| &r.name).collect::<Vec<_>>()),
        other => panic!("List returned {other:?}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}
