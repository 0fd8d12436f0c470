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
use std::time::Duration;

use volume::bench_trace::{OpKind, TraceOptions, VARIANTS};
use volume::client::Cluster;
use volume::meta::{MetaOptions, MetaReq, MetaResp};
use volume::shard_server::ShardOptions;
use volume::types::ShardState;

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
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let meta_addr = listener.local_addr().unwrap().to_string();
    let opts = MetaOptions {
        listen: listener.local_addr().unwrap(),
        dir: dir.join("meta"),
        replicas: 3,
        secret: SECRET.to_vec(),
        ping_interval_ms: 100,
        down_after_ms: 3000,
    };
    tokio::spawn(volume::meta::serve_meta(listener, opts));
    for id in 0..4 {
        let opts = ShardOptions {
            id,
            listen: "127.0.0.1:0".parse().unwrap(),
            advertise: None,
            data_dir: dir.join(format!("shard{id}")),
            meta_addr: meta_addr.clone(),
            secret: SECRET.to_vec(),
            create: true,
        };
        tokio::spawn(volume::shard_server::run_shard(opts));
    }
    let cluster = Cluster::connect(&meta_addr, SECRET).await.unwrap();
    for _ in 0..200 {
        cluster.refresh_map(0).await.ok();
        if let MetaResp::Map(m) = cluster.meta(MetaReq::GetMap).await.unwrap() {
            if m.shards.len() == 4 && m.shards.iter().all(|s| s.state == ShardState::Up) {
                return cluster;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("shards did not come up");
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
    let recording = volume::bench_trace::run_with(cluster.clone(), &opts, &out, &mut report).await.unwrap();

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
    let saved = volume::bench_trace::Trace::load_csv(&out.join("recovery_trace.csv")).unwrap();
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
