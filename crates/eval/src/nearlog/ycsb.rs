//! `bench nearlog ycsb` (SplitFT, "YCSB Throughput"): YCSB A-F over Redis through the project's
//! driver, strong vs weak vs nearlog.

use super::*;

pub fn run(a: YcsbBenchArgs) -> anyhow::Result<bench::Report> {
    use ::ycsb::redis::{RedisOptions, RedisTarget};
    use ::ycsb::{RunConfig, Runner, WorkloadSpec};
    let c = &a.common;
    anyhow::ensure!(a.clients >= 1, "--clients must be at least 1");
    let out = bench::out_dir("nearlog", c.out.clone())?;
    let tmp = tempfile::Builder::new().prefix("nearlog-bench-").tempdir_in(std::env::current_dir()?)?;
    let rt = crate::runtime()?;
    let (rounds, secs) = params(c);
    let records = a.records.unwrap_or(if c.quick { 2000 } else { 20000 });
    let mut report = bench::Report::new("nearlog.ycsb", c.quick);
    let mut csv = vec![];
    for latency in settings(c) {
        let tb = Testbed::start(c, &rt, tmp.path(), latency, if c.quick { "2G" } else { "8G" })?;
        let pfx = latency.prefix();
        let mut bars: BTreeMap<Setup, Vec<f64>> = BTreeMap::new();
        let mut names = vec![];
        for w in a.workloads.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            let mut spec = WorkloadSpec::by_name(w)?;
            spec.record_count = records;
            spec.operation_count = None;
            spec.validate()?;
            let wname = spec.name.clone();
            names.push(wname.clone());
            let mut problems = vec![];
            let runs = interleaved(rounds, |s| {
                let dir = tb.run_dir(&format!("ycsb-{}", s.name()))?;
                let (server, port) = start_redis(&tb, s, &dir)?;
                let mut ctl = redis_client(port)?;
                // Load unmeasured and unsynced; then the setup's own durability for the run.
                let r = ctl.call(&[b"CONFIG", b"SET", b"appendfsync", b"no"])?;
                anyhow::ensure!(is_ok(&r), "CONFIG SET appendfsync answered {r:?}");
                let runner = Runner::new(spec.clone())?;
                let options = RedisOptions { scan_index: spec.has_scans(), ..RedisOptions::default() };
                let config = RunConfig { seed: 1, max_duration: Some(Duration::from_secs_f64(secs)), ..RunConfig::default() };
                let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
                let clients = a.clients;
                let (targets, _load) = rt.block_on(async {
                    let mut targets = Vec::with_capacity(clients);
                    for _ in 0..clients {
                        targets.push(RedisTarget::connect(addr, options.clone()).await?);
                    }
                    anyhow::Ok(runner.load(targets, &config).await?)
                })?;
                let fsync: &[u8] = if s == Setup::Weak { b"no" } else { b"always" };
                let r = ctl.call(&[b"CONFIG", b"SET", b"appendfsync", fsync])?;
                anyhow::ensure!(is_ok(&r), "CONFIG SET appendfsync answered {r:?}");
                let (_, run) = rt.block_on(runner.run(targets, &config))?;
                if !run.all_reads_checked_ok() {
                    problems.push(format!("{} {}: {} missing, {} corrupt: {:?}", wname, s.name(), run.missing_count, run.corrupt_count, run.first_problems));
                }
                drop(server);
                tb.remove_run_dir(&dir, s, REDIS_LOGS)?;
                Ok(Runs { ops: run.completed_ops(), secs: run.elapsed.as_secs_f64(), lat: run.all_latency(), ..Runs::default() })
            })?;
            anyhow::ensure!(problems.is_empty(), "reads returned values the driver never wrote: {problems:?}");
            for (s, r) in &runs {
                let name = format!("{pfx}redis.ycsb_{wname}.{}.c{}", s.name(), a.clients);
                report.figure(&format!("{name}.throughput_ops_per_s"), r.ops_per_s())?;
                report.latency(&format!("{name}.op.latency"), &r.lat.summary())?;
                bars.entry(*s).or_default().push(r.ops_per_s());
                csv.push(vec![latency.name().into(), wname.clone(), s.name().into(), a.clients.to_string(), format!("{:.1}", r.ops_per_s()), r.lat.percentile_us(50.0).to_string(), r.lat.percentile_us(99.0).to_string()]);
                eprintln!("[{}] ycsb {wname} {} c{}: {:.0} ops/s, p99 {} us", tb.what(), s.name(), a.clients, r.ops_per_s(), r.lat.percentile_us(99.0));
            }
            let t = |s: Setup| runs[&s].ops_per_s();
            report.ratio(&format!("{pfx}nearlog_vs_strong.redis.ycsb_{wname}.c{}.throughput", a.clients), t(Setup::Nearlog), t(Setup::Strong))?;
            report.ratio(&format!("{pfx}nearlog_vs_weak.redis.ycsb_{wname}.c{}.throughput", a.clients), t(Setup::Nearlog), t(Setup::Weak))?;
        }
        let series: Vec<bench::BarSeries> = bars.into_iter().map(|(s, values)| bench::BarSeries { name: s.name().into(), values }).collect();
        bench::bar_plot(
            &out.join(format!("redis-ycsb-throughput-{}", latency.name())),
            &format!("Redis YCSB throughput, {} clients, {}", a.clients, tb.what()),
            "workload",
            "throughput (ops/s)",
            &names.iter().map(String::as_str).collect::<Vec<_>>(),
            &series,
        )?;
    }
    bench::write_csv(&out.join("ycsb.csv"), &["latency", "workload", "setup", "clients", "ops_per_s", "p50_us", "p99_us"], csv)?;
    eprintln!("plots and samples in {}", out.display());
    Ok(report)
}
