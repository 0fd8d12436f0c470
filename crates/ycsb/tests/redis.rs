//! The Redis adapter against a real `redis-server` (Debian's package) on a free loopback port
//! in a temporary directory: workloads A and B (and E through the scan index) load and run,
//! and every read after the load must return a value the driver wrote for that key.

use std::time::Duration;

use ycsb::redis::{RedisOptions, RedisServer, RedisServerOptions, RedisTarget, Reply};
use ycsb::value::check_value;
use ycsb::{KvTarget, RequestDistribution, RunConfig, RunError, Runner, WorkloadSpec};

fn server() -> RedisServer {
    RedisServer::start(&RedisServerOptions::default())
        .expect("these tests need redis-server: apt-get install redis-server")
}

async fn clients(server: &RedisServer, n: usize, options: &RedisOptions) -> Vec<RedisTarget> {
    let mut targets = vec![];
    for _ in 0..n {
        targets.push(
            RedisTarget::connect(server.addr(), options.clone())
                .await
                .unwrap(),
        );
    }
    targets
}

fn spec(letter: &str, records: u64, ops: u64) -> WorkloadSpec {
    let mut s = WorkloadSpec::by_name(letter).unwrap();
    s.record_count = records;
    s.operation_count = Some(ops);
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workloads_a_and_b_read_back_what_was_written() {
    for letter in ["a", "b"] {
        let server = server();
        let options = RedisOptions::default();
        let runner = Runner::new(spec(letter, 1000, 3000)).unwrap();
        let config = RunConfig {
            seed: 17,
            max_duration: Some(Duration::from_secs(60)),
            ..RunConfig::default()
        };
        let targets = clients(&server, 4, &options).await;
        let (targets, load) = runner.load(targets, &config).await.unwrap();
        assert_eq!(load.completed_ops(), 1000);
        assert_eq!(load.errors_count, 0);
        let (mut targets, run) = runner.run(targets, &config).await.unwrap();
        assert_eq!(run.errors_count, 0, "{:?}", run.first_problems);
        assert_eq!(run.completed_ops(), 3000, "{letter}");
        assert!(
            run.all_reads_checked_ok(),
            "{letter}: {:?}",
            run.first_problems
        );
        let reads = run.ops["read"].latency.count();
        assert!(reads > 1000, "{letter}: only {reads} reads");
        // Independently of the runner: every loaded record is in Redis, with a value the driver
        // wrote for exactly that key.
        let t = &mut targets[0];
        for k in 0..1000 {
            let key = runner.spec().key_format.key(k);
            let value = t
                .get(&key)
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("{letter}: key {k} lost"));
            check_value(&key, &value).unwrap();
            assert_eq!(value.len(), 1000);
        }
        match t.call(&[b"DBSIZE"]).await.unwrap() {
            Reply::Integer(n) => assert_eq!(n, 1000, "{letter}: A and B insert nothing"),
            other => panic!("DBSIZE: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_the_driver_did_not_write_is_caught() {
    let server = server();
    let options = RedisOptions::default();
    let mut s = spec("c", 20, 1000);
    s.request_distribution = RequestDistribution::Uniform;
    let runner = Runner::new(s).unwrap();
    let config = RunConfig::default();
    let (mut targets, _) = runner
        .load(clients(&server, 2, &options).await, &config)
        .await
        .unwrap();
    let key = runner.spec().key_format.key(5);
    targets[0].put(&key, &[b'x'; 1000]).await.unwrap();
    let gone = runner.spec().key_format.key(6);
    targets[0].call(&[b"DEL", &gone]).await.unwrap();
    let (_, run) = runner.run(targets, &config).await.unwrap();
    assert!(
        run.corrupt_count > 0 && run.missing_count > 0,
        "{:?}",
        run.first_problems
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workload_e_scans_through_the_index_and_needs_it() {
    let server = server();
    let mut s = spec("e", 1000, 1500);
    s.field_length_bytes = 20; // scans carry ~50 records each: keep the test quick
    let runner = Runner::new(s).unwrap();
    let config = RunConfig::default();
    let indexed = RedisOptions {
        scan_index: true,
        ..RedisOptions::default()
    };
    let (targets, _) = runner
        .load(clients(&server, 3, &indexed).await, &config)
        .await
        .unwrap();
    let (mut targets, run) = runner.run(targets, &config).await.unwrap();
    assert_eq!(run.errors_count, 0, "{:?}", run.first_problems);
    assert!(run.all_reads_checked_ok(), "{:?}", run.first_problems);
    let scans = run.ops["scan"].latency.count();
    assert!(scans > 1200, "{scans} scans");
    // Scans start at the chosen key and return the following keys in order.
    let start = runner.spec().key_format.key(0);
    let records = targets[0].scan(&start, 10).await.unwrap();
    assert_eq!(records.len(), 10);
    assert_eq!(records[0].0, start);
    assert!(records.windows(2).all(|w| w[0].0 < w[1].0));
    // Without the index, the run stops at the first scan with the reason.
    let plain = clients(&server, 1, &RedisOptions::default()).await;
    match runner.run(plain, &config).await {
        Err(RunError::Unsupported(e)) => assert!(e.to_string().contains("scan index"), "{e}"),
        other => panic!(
            "expected unsupported scans, got {:?}",
            other.map(|r| r.1.completed_ops())
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_server_gives_errors_not_hangs() {
    let mut server = server();
    let options = RedisOptions {
        op_timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(2),
        ..RedisOptions::default()
    };
    let mut target = RedisTarget::connect(server.addr(), options).await.unwrap();
    target.put(b"k", b"v").await.unwrap();
    server.kill();
    assert!(target.get(b"k").await.is_err());
    // And the next call reconnects, which fails too: nothing listens any more.
    assert!(target.get(b"k").await.is_err());
}
