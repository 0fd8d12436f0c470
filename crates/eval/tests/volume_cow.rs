//! The COW benchmark's workload (`understudy bench volume cow`, SpecREDS §6.2 Figure 4a/4b) at a
//! tiny size, against an in-process cluster (a metadata service and four shards on loopback with
//! real files): checks that it completes and reports every figure; timings are not asserted.

use std::sync::Arc;

use volume::driver::client::Cluster;

const SECRET: &[u8] = b"test-secret";

async fn start_cluster(dir: &std::path::Path) -> Arc<Cluster> {
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_test_writer().try_init();
    volume::testkit::start_in_process(dir, 4, SECRET).await.unwrap()
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("understudy-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cow_benchmark_workload_completes_with_every_figure() {
    let dir = tempdir("benchcow");
    let c = start_cluster(&dir).await;
    let mut opts = eval::volume::cow::CowOptions::new(true);
    opts.writes_per_point = 16;
    opts.iops_seconds = 2;
    opts.iops_rounds = 2;
    let mut report = bench::Report::new("volume.cow", true);
    eval::volume::cow::run(c, &opts, &dir, &mut report).await.unwrap();
    eprintln!("{}", report.to_json_line());
    let json: serde_json::Value = serde_json::from_str(&report.to_json_line()).unwrap();
    for ratio in [
        "super_vs_plain.write_4k.depth1.latency",
        "super_vs_plain.write_4k.depth32.latency",
        "general_vs_super.write_4k.depth32.latency",
        "plain_vs_super_every_1s.parent.iops",
    ] {
        assert!(json["ratios"][ratio].as_f64().is_some_and(|r| r > 0.0), "missing ratio {ratio}: {json}");
    }
    assert!(dir.join("fig4b_cow_latency_by_depth.png").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
