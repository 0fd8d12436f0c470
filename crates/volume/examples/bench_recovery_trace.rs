//! Stand-in for `understudy bench volume recovery-trace [--quick] [--out DIR]` until the CLI
//! wires up `volume::bench_trace::run`: starts an in-process cluster (metadata service + four
//! shards on loopback, data under a temp dir), runs the benchmark, and prints the report's JSON
//! as the last line of stdout. Needs root and /dev/fuse.
//!
//!     cargo run --release -p volume --example bench_recovery_trace -- --quick

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use volume::client::Cluster;
use volume::meta::{MetaOptions, MetaReq, MetaResp};
use volume::shard_server::ShardOptions;
use volume::types::ShardState;

const SECRET: &[u8] = b"bench-recovery-trace";

async fn start_cluster(dir: &std::path::Path) -> anyhow::Result<Arc<Cluster>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let meta_addr = listener.local_addr()?.to_string();
    let opts = MetaOptions {
        listen: listener.local_addr()?,
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
            listen: "127.0.0.1:0".parse()?,
            advertise: None,
            data_dir: dir.join(format!("shard{id}")),
            meta_addr: meta_addr.clone(),
            secret: SECRET.to_vec(),
            create: true,
        };
        tokio::spawn(volume::shard_server::run_shard(opts));
    }
    let cluster = Cluster::connect(&meta_addr, SECRET).await?;
    for _ in 0..200 {
        cluster.refresh_map(0).await.ok();
        if let MetaResp::Map(m) = cluster.meta(MetaReq::GetMap).await? {
            if m.shards.len() == 4 && m.shards.iter().all(|s| s.state == ShardState::Up) {
                return Ok(cluster);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("the four shards did not come up within 10 s")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 3)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let out = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).map(PathBuf::from);
    let out = bench::out_dir("volume", out)?;
    let data_dir = std::env::temp_dir().join(format!("understudy-bench-trace-{}", std::process::id()));
    std::fs::create_dir_all(&data_dir)?;
    let cluster = start_cluster(&data_dir).await?;
    let mut report = bench::Report::new("volume.recovery_trace", quick);
    let r = volume::bench_trace::run(cluster, quick, &out, &mut report).await;
    let _ = std::fs::remove_dir_all(&data_dir);
    r?;
    report.print();
    Ok(())
}
