//! A whole cluster in one process, for integration tests and in-process benchmarks: a metadata
//! service and `shards` storage shards on loopback ports, data under `dir`, real files and real
//! sockets (the CLI's `up` runs the same services as separate processes).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::driver::client::Cluster;
use crate::driver::meta::{MetaOptions, MetaReq, MetaResp};
use crate::driver::shard::ShardOptions;
use crate::types::ShardState;

/// Starts the services as tasks of the current tokio runtime and returns a client once every
/// shard is up.
pub async fn start_in_process(dir: &Path, shards: u32, secret: &[u8]) -> anyhow::Result<Arc<Cluster>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let meta_addr = listener.local_addr()?.to_string();
    let opts = MetaOptions {
        listen: listener.local_addr()?,
        dir: dir.join("meta"),
        replicas: 3.min(shards),
        secret: secret.to_vec(),
        ping_interval_ms: 100,
        down_after_ms: 3000,
        metrics: None,
        control: None,
    };
    tokio::spawn(crate::driver::meta::serve_meta(listener, opts));
    for id in 0..shards {
        let opts = ShardOptions {
            lease: None,
            id,
            listen: "127.0.0.1:0".parse().unwrap(),
            advertise: None,
            data_dir: dir.join(format!("shard{id}")),
            meta_addr: meta_addr.clone(),
            secret: secret.to_vec(),
            create: true,
            metrics: None,
            injected: Default::default(),
            // On here (off by default in `understudy shard`): the in-process cluster tests
            // cover the journal's path, the CLI tests the default one.
            journal_bytes: Some(crate::store::DEFAULT_JOURNAL_BYTES),
        };
        tokio::spawn(crate::driver::shard::run_shard(opts));
    }
    let cluster = Cluster::connect(&meta_addr, secret).await?;
    for _ in 0..400 {
        if let MetaResp::Map(m) = cluster.meta(MetaReq::GetMap).await? {
            if m.shards.len() == shards as usize && m.shards.iter().all(|s| s.state == ShardState::Up) {
                cluster.refresh_map(0).await?;
                return Ok(cluster);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("the shards did not come up within 20 s")
}
