//! The COW benchmark workload (`eval::volume::cow`, SpecREDS §6.2 Figure 4a/4b) through the whole stack
//! — a metadata service and four shards on loopback with real files, three replicas — at a size
//! between the smoke test in `volume_cow.rs` and the full run, to see how the shard's object
//! store shows in the `super_vs_plain` ratios. Prints the report's JSON line.
//!
//! Ignored by default (a measurement). Run in release:
//!
//! ```text
//! CARGO_TARGET_DIR=/work/target-store cargo test --release -p eval --test stack_cow_bench \
//!     -- --ignored --nocapture
//! ```
//!
//! `STACK_BENCH_WRITES` sets writes per variant per point (default 400); `STACK_BENCH_DIR` the
//! data directory (default under /work, the work disk).

use std::sync::Arc;

use volume::driver::client::Cluster;

const SECRET: &[u8] = b"bench-secret";

async fn start_cluster(dir: &std::path::Path) -> Arc<Cluster> {
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_test_writer().try_init();
    volume::testkit::start_in_process(dir, 4, SECRET).await.unwrap()
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
    let mut opts = eval::volume::cow::CowOptions::new(true);
    opts.writes_per_point = std::env::var("STACK_BENCH_WRITES").ok().and_then(|v| v.parse().ok()).unwrap_or(400);
    let mut report = bench::Report::new("volume.cow", true);
    eval::volume::cow::run(c, &opts, &dir.join("out"), &mut report).await.unwrap();
    println!("{}", report.to_json_line());
    let _ = std::fs::remove_dir_all(&dir);
}
