//! The closed-loop runner against the in-memory target: counts, bounds, checks that catch lost
//! and corrupted records, unsupported operations, the error limit, and the report's figures.

use std::time::Duration;

use ycsb::{
    KvTarget, MemTarget, Mix, Proportions, RequestDistribution, RunConfig, RunError, Runner,
    TargetError, WorkloadSpec,
};

fn spec(letter: &str, records: u64, ops: u64) -> WorkloadSpec {
    let mut s = WorkloadSpec::by_name(letter).unwrap();
    s.record_count = records;
    s.operation_count = Some(ops);
    s
}

fn targets(store: &MemTarget, n: usize) -> Vec<MemTarget> {
    (0..n).map(|_| store.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_then_run_counts_every_operation() {
    let store = MemTarget::new();
    let runner = Runner::new(spec("a", 500, 4000)).unwrap();
    let config = RunConfig::default();
    let (t, load) = runner.load(targets(&store, 4), &config).await.unwrap();
    assert_eq!(store.len(), 500);
    assert_eq!(load.completed_ops(), 500);
    assert_eq!(load.ops.keys().copied().collect::<Vec<_>>(), vec!["insert"]);
    let (_, run) = runner.run(t, &config).await.unwrap();
    assert_eq!(run.completed_ops(), 4000);
    assert_eq!(run.windows.count(), 4000);
    assert_eq!(run.clients, 4);
    assert!(run.all_reads_checked_ok(), "{:?}", run.first_problems);
    assert_eq!(run.errors_count, 0);
    let reads = run.ops["read"].latency.count() as f64;
    assert!((reads / 4000.0 - 0.5).abs() < 0.05, "{reads} reads");
    assert_eq!(store.len(), 500, "workload A inserts nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_windows_only_when_asked_and_merged_over_clients() {
    let store = MemTarget::new();
    let runner = Runner::new(spec("b", 200, 3000)).unwrap();
    let (t, load) = runner
        .load(targets(&store, 3), &RunConfig::default())
        .await
        .unwrap();
    assert!(load.latency_windows.is_none(), "off by default");
    let config = RunConfig {
        window: Duration::from_millis(1),
        latency_windows: true,
        ..RunConfig::default()
    };
    let (_, run) = runner.run(t, &config).await.unwrap();
    let windows = run.latency_windows.as_ref().expect("asked for");
    // Every completion of every client, in the same windows as the throughput counter.
    assert_eq!(windows.count(), 3000);
    assert_eq!(windows.window(), Duration::from_millis(1));
    let stats = windows.windows(run.elapsed).unwrap();
    let counter = run.windows.ops_per_s();
    for (w, rate) in stats.iter().zip(&counter) {
        assert_eq!(w.ops_per_s, *rate, "window at {:?}", w.start);
        assert_eq!(w.p50_us.is_some(), w.count > 0);
    }
    assert!(run.started.elapsed() >= run.elapsed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inserts_grow_the_store_and_latest_reads_find_them() {
    for letter in ["d", "e"] {
        let store = MemTarget::new();
        let mut s = spec(letter, 300, 3000);
        s.field_length_bytes = 10; // E scans ~50 records an operation: keep the checks cheap
        let runner = Runner::new(s).unwrap();
        let config = RunConfig {
            seed: 9,
            ..RunConfig::default()
        };
        let (t, _) = runner.load(targets(&store, 3), &config).await.unwrap();
        let (_, run) = runner.run(t, &config).await.unwrap();
        let inserts = run.ops["insert"].latency.count() as usize;
        assert!(inserts > 50, "{letter}: {inserts} inserts");
        assert_eq!(store.len(), 300 + inserts, "{letter}");
        assert!(
            run.all_reads_checked_ok(),
            "{letter}: {:?}",
            run.first_problems
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tao_mix_runs_clean() {
    let store = MemTarget::new();
    let runner = Runner::new(spec("tao", 400, 5000)).unwrap();
    let config = RunConfig::default();
    let (t, load) = runner.load(targets(&store, 4), &config).await.unwrap();
    assert_eq!(store.len(), 800, "an object and an association list per id");
    assert_eq!(load.completed_ops(), 800);
    let (_, run) = runner.run(t, &config).await.unwrap();
    assert_eq!(run.completed_ops(), 5000);
    assert!(run.all_reads_checked_ok(), "{:?}", run.first_problems);
    for label in [
        "obj_get",
        "assoc_range",
        "assoc_add",
        "obj_update",
        "obj_add",
    ] {
        assert!(
            run.ops.contains_key(label),
            "{label} missing from {:?}",
            run.ops.keys()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_and_corrupted_records_are_caught() {
    let store = MemTarget::new();
    let mut s = spec("c", 20, 2000);
    s.request_distribution = RequestDistribution::Uniform;
    let runner = Runner::new(s).unwrap();
    let config = RunConfig::default();
    let (t, _) = runner.load(targets(&store, 2), &config).await.unwrap();
    let key = |k| ycsb::KeyFormat::default().key(k);
    // One record lost, one with another record's value, one with a flipped byte.
    store.remove_raw(&key(0));
    store.set_raw(&key(1), &store.value(&key(2)).unwrap());
    let mut flipped = store.value(&key(3)).unwrap();
    flipped[500] ^= 1;
    store.set_raw(&key(3), &flipped);
    let (_, run) = runner.run(t, &config).await.unwrap();
    assert!(!run.all_reads_checked_ok());
    // Uniform over 20 keys: each is read about 100 times.
    assert!(run.missing_count > 50, "missing {}", run.missing_count);
    assert!(run.corrupt_count > 100, "corrupt {}", run.corrupt_count);
    assert!(run.first_problems.iter().any(|p| p.contains("missing")));
    assert!(run.first_problems.iter().any(|p| p.contains("another key")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duration_bounds_the_run() {
    let store = MemTarget::new();
    let mut s = spec("b", 100, 0);
    s.operation_count = None;
    let runner = Runner::new(s).unwrap();
    let config = RunConfig {
        max_duration: Some(Duration::from_millis(300)),
        ..RunConfig::default()
    };
    let (t, _) = runner.load(targets(&store, 2), &config).await.unwrap();
    let (_, run) = runner.run(t, &config).await.unwrap();
    assert!(run.elapsed >= Duration::from_millis(300));
    assert!(run.elapsed < Duration::from_secs(5));
    assert!(run.completed_ops() > 0);
    assert!(
        run.window_ops_per_s().len() >= 2,
        "100 ms windows over 300 ms"
    );
    // Neither bound: refused.
    let mut s = spec("b", 100, 0);
    s.operation_count = None;
    let runner = Runner::new(s).unwrap();
    let err = runner
        .run(targets(&store, 1), &RunConfig::default())
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("operation count, a duration"),
        "{err}"
    );
}

/// A target without scans whose every `fail_every`-th operation fails.
struct Flaky {
    inner: MemTarget,
    calls: u64,
    fail_every: u64,
}

impl Flaky {
    fn tick(&mut self) -> Result<(), TargetError> {
        self.calls += 1;
        if self.fail_every > 0 && self.calls.is_multiple_of(self.fail_every) {
            return Err(TargetError::Io("connection reset (injected)".into()));
        }
        Ok(())
    }
}

impl KvTarget for Flaky {
    fn name(&self) -> &'static str {
        "flaky"
    }
    async fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, TargetError> {
        self.tick()?;
        self.inner.get(key).await
    }
    async fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), TargetError> {
        self.tick()?;
        self.inner.put(key, value).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_scans_stop_the_run_with_a_clear_error() {
    let runner = Runner::new(spec("e", 100, 100)).unwrap();
    let store = MemTarget::new();
    let flaky = || Flaky {
        inner: store.clone(),
        calls: 0,
        fail_every: 0,
    };
    let config = RunConfig::default();
    let (t, _) = runner.load(vec![flaky(), flaky()], &config).await.unwrap();
    match runner.run(t, &config).await {
        Err(RunError::Unsupported(e)) => {
            assert!(e.to_string().contains("scan is not supported by flaky"))
        }
        other => panic!(
            "expected unsupported scans, got {:?}",
            other.map(|r| r.1.completed_ops())
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_counted_up_to_the_limit() {
    let store = MemTarget::new();
    let mut s = spec("a", 100, 1000);
    s.mix = Mix::Ycsb(Proportions {
        read: 0.5,
        update: 0.5,
        ..Default::default()
    });
    let runner = Runner::new(s).unwrap();
    let config = RunConfig {
        max_errors: u64::MAX,
        ..RunConfig::default()
    };
    let (t, _) = runner.load(targets(&store, 2), &config).await.unwrap();
    // One client, so that exactly every tenth operation fails.
    let flaky: Vec<Flaky> = t
        .into_iter()
        .take(1)
        .map(|inner| Flaky {
            inner,
            calls: 0,
            fail_every: 10,
        })
        .collect();
    let (flaky, run) = runner.run(flaky, &config).await.unwrap();
    assert_eq!(run.errors_count, 100, "every tenth of 1000 operations");
    assert_eq!(run.completed_ops(), 900);
    assert!(run.all_reads_checked_ok());
    let limited = RunConfig {
        max_errors: 5,
        ..RunConfig::default()
    };
    match runner.run(flaky, &limited).await {
        Err(RunError::TooManyErrors {
            count,
            limit: 5,
            first,
        }) => {
            assert!(count > 5);
            assert!(first.contains("injected"), "{first}");
        }
        other => panic!(
            "expected too many errors, got {:?}",
            other.map(|r| r.1.errors_count)
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn summary_becomes_bench_md_figures() {
    let store = MemTarget::new();
    let runner = Runner::new(spec("f", 200, 2000)).unwrap();
    let config = RunConfig::default();
    let (t, load) = runner.load(targets(&store, 2), &config).await.unwrap();
    let (_, run) = runner.run(t, &config).await.unwrap();
    let mut report = bench::Report::new("ycsb.memory", true);
    load.add_to_report("memory.f.load", &mut report).unwrap();
    run.add_to_report("memory.f.run", &mut report).unwrap();
    let json: serde_json::Value = serde_json::from_str(&report.to_json_line()).unwrap();
    let figures = json["figures"].as_object().unwrap();
    for name in [
        "memory.f.run.throughput_ops_per_s",
        "memory.f.run.read.latency_us_p99",
        "memory.f.run.read_modify_write.latency_us_p50",
        "memory.f.run.read_modify_write.ops_count",
        "memory.f.run.missing_count",
        "memory.f.load.insert.latency_us_mean",
    ] {
        assert!(
            figures.contains_key(name),
            "{name} not in {:?}",
            figures.keys()
        );
    }
    assert_eq!(figures["memory.f.run.missing_count"], 0.0);
    assert!(
        figures["memory.f.run.throughput_ops_per_s"]
            .as_f64()
            .unwrap()
            > 0.0
    );
}
