//! The COW benchmark workload (`bench_cow`, SpecREDS §6.2 Figure 4a/4b) through the whole stack
//! — a metadata service and four shards on loopback with real files, three replicas — at a size
//! between the smoke test in `runtime_cluster.rs` and the full run, to see how the shard's object
//! store shows in the `super_vs_plain` ratios. Prints the report's JSON line.
//!
//! Ignored by default (a measurement). Run in release:
//!
//! ```text
//! CARGO_TARGET_DIR=/work/target-store cargo test --release -p volume --test stack_cow_bench \
//!     -- --ignored --nocapture
//! ```
//!
//! `STACK_BENCH_WRITES` sets writes per variant per point (default 400); `STACK_BENCH_DIR` the
//! data directory (default under /work, the work disk).

use std::sync::Arc;
use std::time::Duration;

use volume::client::Cluster;
use volume::meta::{MetaOptions, MetaReq, MetaResp};
use volume::shard_server::ShardOptions;
use volume::types::ShardState;

const SECRET: &[u8] = b"bench-secret";

async fn start_cluster(dir: &std::path::Path) -> Arc<Cluster> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let meta_addr = listener.local_addr().unwrap().to_string();
    let opts = MetaOptions {
        listen: listener.local_addr().unwrap(),
        dir: dir.join("meta"),
        replicas: 3,
        secret: SECRET.to_vec(),
        ping_interval_ms: 100,
        down_after_ms: 3000,
        metrics: None,
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
            metrics: None,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run with --ignored --nocapture in release"]
async fn stack_cow_latency() {
    let dir = std::env::var("STACK_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::path::PathBuf::from(format!("/work/stack-bench-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::create_dir_all(dir.join("out")).unwrap();
    let c = start_cluster(&dir).await;
    let mut opts = volume::bench_cow::CowOptions::new(true);
    opts.writes_per_point = std::env::var("STACK_BENCH_WRITES").ok().and_then(|v| v.parse().ok()).unwrap_or(400);
    let mut report = bench::Report::new("volume.cow", true);
    volume::bench_cow::run(c, &opts, &dir.join("out"), &mut report).await.unwrap();
    println!("{}", report.to_json_line());
    let _ = std::fs::remove_dir_all(&dir);
}
