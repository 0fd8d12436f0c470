//! `understudy bench failover recovery`: application recovery latency on the plain volume, a
//! super clone and a general clone (SpecREDS §6.3), for PostgreSQL, SQLite and MariaDB with
//! RocksDB, clean and unclean failures, a small and a large WAL.
//!
//! Instances run through the same [`LocalPool`] the monitor uses (its volume attached as ext4
//! through FUSE and a loop device), in this process. Per application and WAL size one volume
//! and one primary; then, per failure kind (`--failure kill|clean`), ABBA-interleaved crash
//! rounds: each loads the primary until the WAL since its last checkpoint reaches the size,
//! fails it (a kill: disk fenced, application SIGKILLed, no flush; or a clean stop), recovers a
//! general clone of that state (full runs), then recovers the round's kind — a restart on the
//! volume itself (plain) or a backup on a super child that is then promoted by collapse, as a
//! speculative failover does — which becomes the next round's primary. Each is timed from the
//! moment its process starts (the volume is attached by then) to its first good health check;
//! a cell's figure is the median of its rounds. Every recovery prints what the shards did
//! meanwhile (child first writes, in-place writes, reads: their counters before and after).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use ::failover::driver::Volumes;
use ::failover::health::health_check;
use ::failover::pg::PgConn;
use ::failover::pool::{InstancePool, LocalPool, LocalPoolConfig};
use ::failover::spec::{AppSpec, HealthSpec, PgTarget};
use ::failover::{Input, InstanceId};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use volume::driver::meta::{MetaReq, MetaResp};

use super::breakdown::Breakdown;
use testbed::volume::{LocalCluster, UpConfig, READY_TIMEOUT};

#[derive(Args, Debug)]
pub struct RecoveryArgs {
    /// A short run: one AB pair of crash rounds per failure, the small WAL only, no general
    /// clone.
    #[arg(long)]
    pub quick: bool,
    /// Where plots and CSV go [default: target/bench/failover].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// ABBA pairs of crash rounds (plain, super) per application, WAL size and failure
    /// [default: 1 with --quick, else 2].
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Only these failures: `kill` (SIGKILL, no flush) or `clean` (shutdown and unmount)
    /// [default: both].
    #[arg(long = "failure", value_name = "FAILURE")]
    pub failures: Vec<String>,
    /// Only these applications (postgres, sqlite, mariadb) [default: all three].
    #[arg(long = "app", value_name = "APP")]
    pub apps: Vec<String>,
}

const SMALL_WAL_BYTES: u64 = 4 << 20;
const LARGE_WAL_BYTES: u64 = 192 << 20;
/// How long an instance may take to become healthy.
const HEALTHY_TIMEOUT: Duration = Duration::from_secs(600);
/// How long loading one WAL size may take at most.
const FILL_TIMEOUT: Duration = Duration::from_secs(600);
const CLONES: [&str; 3] = ["plain", "super", "general"];
const FAILURES: [&str; 2] = ["unclean", "clean"];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum App {
    Postgres,
    Sqlite,
    /// MariaDB with the RocksDB engine: its WAL is RocksDB's (`#rocksdb/*.log`).
    Mariadb,
}

impl App {
    fn name(self) -> &'static str {
        match self {
            App::Postgres => "postgres",
            App::Sqlite => "sqlite",
            App::Mariadb => "mariadb",
        }
    }
}

/// RocksDB's WAL files of a MariaDB data directory, in bytes.
fn rocksdb_wal_bytes(mount: &Path) -> u64 {
    std::fs::read_dir(mount.join("mysql").join("#rocksdb"))
        .map(|d| d.flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".log")).filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

struct Sample {
    app: App,
    wal: &'static str,
    failure: &'static str,
    clone: &'static str,
    wal_bytes: u64,
    app_recovery_ms: f64,
    attach_ms: f64,
    /// Where start → healthy went.
    parts: Option<Breakdown>,
}

/// One instance recovered: where it serves, its times, where they went.
struct Recovered {
    id: InstanceId,
    addr: SocketAddr,
    attach_ms: f64,
    app_ms: f64,
    parts: Option<Breakdown>,
    /// What the shards did from the start to the first good health check.
    work: Option<super::shardtrace::PhaseWork>,
}

fn app_spec(exe: &Path, app: App, wal_bytes: u64) -> (AppSpec, HealthSpec) {
    let exe = exe.to_string_lossy().to_string();
    let command: Vec<String> = match app {
        App::Postgres => {
            // Checkpoints are requested at about max_wal_size / (1 + completion target): twice
            // and a half the WAL we mean to leave keeps them away; the timeout keeps time
            // from triggering one.
            let mb = ((wal_bytes * 5 / 2) >> 20).max(32);
            vec![
                exe,
                "failover".into(),
                "postgres".into(),
                "--data".into(),
                "{mount}/pgdata".into(),
                "--port".into(),
                "{port}".into(),
                "--max-wal-size-mb".into(),
                mb.to_string(),
                "--checkpoint-timeout-s".into(),
                "3600".into(),
            ]
        }
        App::Mariadb => {
            // RocksDB keeps its WAL until the memtables holding its writes are flushed: a
            // memtable larger than the WAL we mean to leave keeps it all.
            let buffer = (wal_bytes * 2).max(64 << 20);
            vec![
                exe,
                "failover".into(),
                "mariadb".into(),
                "--data".into(),
                "{mount}/mysql".into(),
                "--port".into(),
                "{port}".into(),
                "--set".into(),
                format!("rocksdb-default-cf-options=write_buffer_size={buffer}"),
                "--set".into(),
                format!("rocksdb-db-write-buffer-size={}", buffer * 2),
                "--set".into(),
                format!("rocksdb-max-total-wal-size={}", buffer * 4),
            ]
        }
        App::Sqlite => {
            // The small WAL: SQLite's automatic checkpoint keeps it near 4 MiB; the large: none.
            let pages = if wal_bytes > SMALL_WAL_BYTES { 0 } else { 1000 };
            vec![
                exe,
                "failover".into(),
                "sqlite-front".into(),
                "--db".into(),
                "{mount}/app.db".into(),
                "--port".into(),
                "{port}".into(),
                "--wal-autocheckpoint-pages".into(),
                pages.to_string(),
            ]
        }
    };
    let health = match app {
        App::Postgres => HealthSpec {
            send: Some("SELECT 1".into()),
            expect: Some("1".into()),
            command: None,
            postgres: Some(PgTarget::default()),
            mysql: None,
            timeout_ms: 1000,
        },
        App::Mariadb => HealthSpec {
            send: Some("SELECT 1".into()),
            expect: Some("1".into()),
            command: None,
            postgres: None,
            mysql: Some(Default::default()),
            timeout_ms: 1000,
        },
        App::Sqlite => HealthSpec { send: Some("PING".into()), expect: Some("PONG".into()), command: None, postgres: None, mysql: None, timeout_ms: 1000 },
    };
    (AppSpec { command, env: Default::default(), stop_grace_ms: 60_000 }, health)
}

async fn wait_healthy(pool: &LocalPool, h: &HealthSpec, addr: SocketAddr, id: InstanceId) -> anyhow::Result<Instant> {
    let deadline = Instant::now() + HEALTHY_TIMEOUT;
    loop {
        if health_check(h, addr, id).await {
            return Ok(Instant::now());
        }
        if !pool.pids(id).is_some_and(|(app, _)| ::failover::pool::pid_alive(app)) {
            let log = std::fs::read_to_string(pool.log_file(id)).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            anyhow::bail!("the application of instance {id} exited before it was healthy: {}", tail.into_iter().rev().collect::<Vec<_>>().join(" | "));
        }
        anyhow::ensure!(Instant::now() < deadline, "instance {id} not healthy within {HEALTHY_TIMEOUT:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Loads the primary until at least `wal_bytes` of WAL wait for recovery; returns how much.
async fn fill(app: App, addr: SocketAddr, mount: &Path, wal_bytes: u64) -> anyhow::Result<u64> {
    let deadline = Instant::now() + FILL_TIMEOUT;
    match app {
        App::Postgres => {
            let mut c = PgConn::connect(addr, "postgres", "postgres", Duration::from_secs(60)).await?;
            c.query("CREATE TABLE IF NOT EXISTS fill(id bigserial, payload text)").await?;
            // Start from a checkpoint, so the WAL to replay is exactly what follows.
            c.query("CHECKPOINT").await?;
            loop {
                let rows = c.query("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), redo_lsn)::bigint FROM pg_control_checkpoint()").await?;
                let have: u64 = rows.first().and_then(|r| r.first().cloned().flatten()).and_then(|s| s.parse().ok()).context("no WAL position")?;
                if have >= wal_bytes {
                    c.close().await;
                    return Ok(have);
                }
                anyhow::ensure!(Instant::now() < deadline, "only {have} bytes of WAL after {FILL_TIMEOUT:?}");
                // About 1 MiB of rows per statement; random text so nothing compresses.
                c.query("INSERT INTO fill(payload) SELECT repeat(md5(random()::text), 16) FROM generate_series(1, 2000)").await?;
            }
        }
        App::Mariadb => {
            let mut c = ::failover::mysql::MyConn::connect(addr, "root", Duration::from_secs(60)).await?;
            c.query("CREATE DATABASE IF NOT EXISTS understudy").await?;
            c.query("CREATE TABLE IF NOT EXISTS understudy.fill(id bigint AUTO_INCREMENT PRIMARY KEY, payload text)").await?;
            // Start from empty memtables (a flush), so the WAL to replay is what follows.
            c.query("SET GLOBAL rocksdb_force_flush_memtable_now = 1").await?;
            loop {
                let have = rocksdb_wal_bytes(mount);
                if have >= wal_bytes {
                    c.close().await;
                    return Ok(have);
                }
                anyhow::ensure!(Instant::now() < deadline, "only {have} bytes of WAL after {FILL_TIMEOUT:?}");
                c.query("INSERT INTO understudy.fill(payload) SELECT REPEAT(MD5(RAND()), 16) FROM understudy.seq_1_to_2000").await?;
            }
        }
        App::Sqlite => {
            let s = tokio::net::TcpStream::connect(addr).await?;
            let mut s = BufReader::new(s);
            let wal = mount.join("app.db-wal");
            // Start from an empty WAL (a checkpoint that truncates it), so the WAL to recover
            // is what follows: the file would otherwise keep an earlier round's size.
            s.get_mut().write_all(b"CHECKPOINT\n").await?;
            let mut line = String::new();
            s.read_line(&mut line).await?;
            anyhow::ensure!(line.starts_with("CHECKPOINTED"), "the SQLite front answered {line:?} to CHECKPOINT");
            loop {
                let have = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
                if have >= wal_bytes {
                    return Ok(have);
                }
                anyhow::ensure!(Instant::now() < deadline, "only {have} bytes of WAL after {FILL_TIMEOUT:?}");
                s.get_mut().write_all(b"FILL 1000 1000\n").await?;
                let mut line = String::new();
                s.read_line(&mut line).await?;
                anyhow::ensure!(line.starts_with("FILLED"), "the SQLite front answered {line:?}");
                // With automatic checkpoints (the small WAL) the file stays near their size:
                // stop once it has grown past the size asked, or after enough rows.
                if wal_bytes <= SMALL_WAL_BYTES {
                    let have = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
                    if have >= wal_bytes * 3 / 4 {
                        return Ok(have);
                    }
                }
            }
        }
    }
}

struct Bench {
    pool: Arc<LocalPool>,
    volumes: Volumes,
    health: HealthSpec,
    next_id: u64,
    /// The shards' metrics addresses (their counters around each recovery).
    shard_metrics: Vec<String>,
}

impl Bench {
    fn id(&mut self) -> InstanceId {
        self.next_id += 1;
        InstanceId(self.next_id)
    }

    /// The shards' counters now (blocking scrapes, off the runtime's threads).
    async fn counters(&self) -> Option<super::shardtrace::Counters> {
        let addrs = self.shard_metrics.clone();
        tokio::task::spawn_blocking(move || super::shardtrace::scrape(&addrs)).await.ok().flatten()
    }

    /// Starts an instance on `vol` and waits for its first good health check.
    async fn recover_on(&mut self, vol: &str) -> anyhow::Result<Recovered> {
        let id = self.id();
        let before = self.counters().await;
        let t0 = Instant::now();
        let asked_unix = ::failover::proto::now_unix_ms() as f64;
        let addr = self.pool.start(id, vol).await.with_context(|| format!("starting an instance on {vol}"))?;
        let started = Instant::now();
        let healthy = wait_healthy(&self.pool, &self.health, addr, id).await?;
        let healthy_unix = ::failover::proto::now_unix_ms() as f64 - healthy.elapsed().as_secs_f64() * 1000.0;
        let parts = self.pool.start_timing(id).and_then(|t| super::breakdown::of(asked_unix, healthy_unix, &t, &self.pool.log_file(id), 0.0));
        let work = before.zip(self.counters().await).map(|(b, a)| super::shardtrace::work_between(&b, &a));
        Ok(Recovered { id, addr, attach_ms: (started - t0).as_secs_f64() * 1000.0, app_ms: (healthy - started).as_secs_f64() * 1000.0, parts, work })
    }

    /// Waits until the metadata service has no job left: a promotion's garbage collection
    /// (the parent's objects handed to the child) is over before the next round loads the
    /// volume, so no round pays for the previous one's.
    async fn wait_gc_end(&self) -> anyhow::Result<()> {
        let t0 = Instant::now();
        loop {
            match self.meta(MetaReq::Jobs).await? {
                MetaResp::Jobs(j) if j.is_empty() => return Ok(()),
                MetaResp::Jobs(_) => {}
                other => anyhow::bail!("unexpected answer to Jobs: {other:?}"),
            }
            anyhow::ensure!(t0.elapsed() < FILL_TIMEOUT, "garbage collection still running after {FILL_TIMEOUT:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn meta(&self, req: MetaReq) -> anyhow::Result<MetaResp> {
        self.volumes.cluster.meta(req).await
    }
}

/// One application and WAL size on its own volume: a primary booted once, then for each failure
/// kind `rounds` ABBA pairs of crash rounds (plain, super, super, plain, …). Every round loads
/// the primary to the same WAL size and fails it; with `general`, a general clone of the failed
/// state is recovered first (the same for both kinds); then the round's kind recovers: a restart
/// on the volume itself (plain), or a backup on a super child that is then collapsed —
/// promoted, as in a speculative failover — and carries on as the volume once its garbage
/// collection has ended (so the next round does not pay for this one's). Either way the
/// recovered instance is the next round's primary. Alternating the kinds over rounds cancels the
/// machine's drift (a neighbour's build, a warming cache) instead of always favouring the one
/// measured second.
#[allow(clippy::too_many_arguments)]
async fn cell(
    exe: &Path,
    conn_args: &[String],
    dir: &Path,
    cluster: Arc<volume::driver::client::Cluster>,
    shard_metrics: &[String],
    app: App,
    wal: &'static str,
    wal_bytes: u64,
    rounds: usize,
    failures: &[&'static str],
    general: bool,
    samples: &mut Vec<Sample>,
) -> anyhow::Result<()> {
    let vol = format!("rec-{}-{wal}", app.name());
    // MariaDB's InnoDB alone takes ~110 MiB (system tablespace, 96 MiB redo log). Every crash
    // round (and the warm-up) leaves about a WAL's worth of rows in the table, and the WAL
    // itself is kept up to PostgreSQL's max_wal_size (2.5 WALs): a full run of the large WAL
    // filled a volume sized for 4 WALs ("No space left on device"). Thin: unused size is free.
    let crash_rounds = 1 + 2 * rounds * failures.len();
    let size = 512 * 1024 * 1024 + wal_bytes * (4 + crash_rounds as u64);
    match cluster.meta(MetaReq::Create { name: vol.clone(), size_bytes: size.next_multiple_of(4 << 20), object_size_bytes: volume::driver::meta::DEFAULT_OBJECT_SIZE_BYTES }).await {
        Ok(_) => {}
        Err(e) => anyhow::bail!("creating volume {vol}: {e:#}"),
    }
    let (app_spec, health) = app_spec(exe, app, wal_bytes);
    let state_dir = dir.join(&vol);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Input>(64);
    // Instance exits are expected here (we cause them); drain the channel.
    tokio::spawn(async move { while rx.recv().await.is_some() {} });
    let pool = Arc::new(LocalPool::new(
        LocalPoolConfig {
            exe: exe.to_path_buf(),
            conn_args: conn_args.to_vec(),
            state_dir: state_dir.clone(),
            app: app_spec,
            mkfs_first: true,
            attach_timeout: Duration::from_secs(300),
            // Recovery latency is the application's own: no network namespace needed.
            netns: false,
        },
        tx,
    )?);
    let mut b = Bench { pool: pool.clone(), volumes: Volumes { cluster }, health, next_id: 0, shard_metrics: shard_metrics.to_vec() };
    let r = async {
        // The volume the primary runs on (after a promotion: the promoted child).
        let mut cur = vol.clone();
        let r = b.recover_on(&cur).await?;
        let (mut primary, mut addr) = (r.id, r.addr);
        eprintln!("failover recovery bench: {} {wal}: primary up ({:.0} ms to healthy)", app.name(), r.app_ms);
        // One crash round not recorded: the first recovery after a fresh database is much
        // slower (seen: 2-3x for PostgreSQL), and would count against whichever kind the
        // ABBA order happens to put first.
        fill(app, addr, &pool.mount_dir(primary), wal_bytes).await?;
        pool.kill(primary).await?;
        let r = b.recover_on(&cur).await?;
        eprintln!("failover recovery bench: {} {wal}: warm-up crash round ({:.0} ms to healthy, not recorded)", app.name(), r.app_ms);
        (primary, addr) = (r.id, r.addr);
        let mut n = 0;
        for &failure in failures {
            for kind in bench::interleaved_order(rounds, 2) {
                n += 1;
                let have = fill(app, addr, &pool.mount_dir(primary), wal_bytes).await?;
                match failure {
                    "unclean" => pool.kill(primary).await?,
                    _ => pool.stop(primary).await?,
                }
                let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
                let load: String = load.split_whitespace().next().unwrap_or("?").into();
                let mut record = |clone: &'static str, r: Recovered| {
                    eprintln!(
                        "failover recovery bench: {} {wal} WAL ({have} bytes) {failure} on {clone}: attach {:.0} ms, app recovery {:.0} ms (load {load}; {}); shards: {}",
                        app.name(),
                        r.attach_ms,
                        r.app_ms,
                        r.parts.as_ref().map(Breakdown::line).unwrap_or_default(),
                        r.work.as_ref().map(super::shardtrace::PhaseWork::line).unwrap_or_else(|| "no counters".into()),
                    );
                    samples.push(Sample { app, wal, failure, clone, wal_bytes: have, app_recovery_ms: r.app_ms, attach_ms: r.attach_ms, parts: r.parts });
                };
                if general {
                    let child = format!("{vol}.general-{n}");
                    b.meta(MetaReq::CloneGeneral { parent: cur.clone(), child: child.clone() }).await.context("general clone")?;
                    let r = b.recover_on(&child).await?;
                    let id = r.id;
                    record("general", r);
                    pool.kill(id).await?;
                    b.meta(MetaReq::Delete { name: child.clone() }).await.context("deleting the general clone")?;
                }
                if kind == 0 {
                    let r = b.recover_on(&cur).await?;
                    (primary, addr) = (r.id, r.addr);
                    record("plain", r);
                } else {
                    let child = format!("{vol}.super-{n}");
                    match b.volumes.super_(&cur, &child).await {
                        Input::SuperDone { .. } => {}
                        other => anyhow::bail!("super of {cur}: {other:?}"),
                    }
                    let r = b.recover_on(&child).await?;
                    (primary, addr) = (r.id, r.addr);
                    record("super", r);
                    match b.volumes.collapse(&cur, &child).await {
                        Input::CollapseDone { outcome: ::failover::CollapseOutcome::Promoted, .. } => {}
                        other => anyhow::bail!("collapse of {child} into {cur}: {other:?}"),
                    }
                    cur = child;
                    b.wait_gc_end().await?;
                }
            }
        }
        pool.kill(primary).await?;
        anyhow::Ok(())
    }
    .await;
    if r.is_err() {
        for id in pool.instances() {
            let _ = pool.kill(id).await;
        }
    }
    r
}

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = v.collect();
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

pub fn run(a: RecoveryArgs, verbose: u8) -> anyhow::Result<bench::Report> {
    let rounds = a.rounds.unwrap_or(if a.quick { 1 } else { 2 }).max(1);
    let mut apps = vec![];
    let all = ["postgres", "sqlite", "mariadb"].map(String::from).to_vec();
    for name in if a.apps.is_empty() { all } else { a.apps.clone() } {
        apps.push(match name.as_str() {
            "postgres" => App::Postgres,
            "sqlite" => App::Sqlite,
            "mariadb" => App::Mariadb,
            other => anyhow::bail!("unknown application {other:?} (postgres, sqlite, mariadb)"),
        });
    }
    if apps.contains(&App::Mariadb) {
        anyhow::ensure!(Path::new("/usr/sbin/mariadbd").exists(), "MariaDB is not installed (apt-get install mariadb-server mariadb-plugin-rocksdb)");
    }
    if apps.contains(&App::Postgres) {
        anyhow::ensure!(testbed::postgres::find_bin_dir().is_some(), "PostgreSQL is not installed (apt-get install postgresql)");
    }
    let mut failures = vec![];
    for f in if a.failures.is_empty() { vec!["kill".to_string(), "clean".to_string()] } else { a.failures.clone() } {
        let f = match f.as_str() {
            "kill" => "unclean",
            "clean" => "clean",
            other => anyhow::bail!("unknown failure {other:?} (kill or clean)"),
        };
        if !failures.contains(&f) {
            failures.push(f);
        }
    }
    let wals: Vec<(&'static str, u64)> = if a.quick { vec![("small_wal", SMALL_WAL_BYTES)] } else { vec![("small_wal", SMALL_WAL_BYTES), ("large_wal", LARGE_WAL_BYTES)] };
    let out = bench::out_dir("failover", a.out.clone())?;
    let base = std::env::current_dir()?.join("target").join("bench-clusters");
    std::fs::create_dir_all(&base)?;
    let dir = tempfile::Builder::new().prefix("understudy-recovery-").tempdir_in(&base)?;
    // postgres runs unprivileged: it must reach its data directory under here.
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let rt = crate::runtime()?;
    // Shards serve their metrics: their counters around each recovery.
    let mut lc = LocalCluster::start_full(&UpConfig { dir: dir.path().join("cluster"), shards: 4, replicas: 3, port_base: 0, verbose }, &[], true)?;
    rt.block_on(lc.wait_ready(READY_TIMEOUT, false))?;
    let cluster_file = lc.info.dir.join(testbed::cluster_file::CLUSTER_FILE);
    lc.info.save(&cluster_file)?;
    let exe = std::env::current_exe()?;
    let conn_args = vec!["--cluster".to_string(), cluster_file.to_string_lossy().into_owned()];
    let shard_metrics: Vec<String> = lc.info.shards.iter().filter_map(|s| s.metrics.clone()).collect();
    let mut samples = vec![];
    let r = rt.block_on(async {
        let cluster = testbed::cluster_file::Target::resolve(Some(&cluster_file), None, None)?.connect().await?;
        for &app in &apps {
            for &(wal, bytes) in &wals {
                cell(&exe, &conn_args, dir.path(), cluster.clone(), &shard_metrics, app, wal, bytes, rounds, &failures, !a.quick, &mut samples).await?;
            }
        }
        anyhow::Ok(())
    });
    lc.stop();
    r?;

    let mut report = bench::Report::new("failover.recovery", a.quick);
    let mut groups = vec![];
    // The general clone only where it was measured (not with --quick).
    let clones: Vec<&str> = CLONES.iter().copied().filter(|c| samples.iter().any(|s| s.clone == *c)).collect();
    let mut bars: Vec<bench::BarSeries> = clones.iter().map(|c| bench::BarSeries { name: c.to_string(), values: vec![] }).collect();
    // Per cell, the median over its crash rounds: a disturbed round does not make the figure.
    let median = |mut v: Vec<f64>| -> f64 {
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    };
    let (mut super_sum, mut plain_sum, mut general_sum) = (0.0, 0.0, 0.0);
    for &app in &apps {
        for wal in ["small_wal", "large_wal"] {
            for failure in FAILURES {
                let cell: Vec<&Sample> = samples.iter().filter(|s| s.app == app && s.wal == wal && s.failure == failure).collect();
                if cell.is_empty() {
                    continue;
                }
                let prefix = format!("{}.{wal}.{failure}", app.name());
                report.figure(&format!("{prefix}.wal_bytes_mean"), mean(cell.iter().map(|s| s.wal_bytes as f64)))?;
                let mut m = [0.0; 3];
                for (i, c) in CLONES.iter().enumerate() {
                    let of = |f: fn(&Sample) -> f64| cell.iter().filter(|s| s.clone == *c).map(|s| f(s)).collect::<Vec<f64>>();
                    if of(|s| s.app_recovery_ms).is_empty() {
                        continue;
                    }
                    m[i] = median(of(|s| s.app_recovery_ms));
                    report.figure(&format!("{prefix}.{c}.app_recovery_latency_ms_mean"), mean(of(|s| s.app_recovery_ms).into_iter()))?;
                    report.figure(&format!("{prefix}.{c}.app_recovery_latency_ms_p50"), m[i])?;
                    report.figure(&format!("{prefix}.{c}.rounds_count"), of(|s| s.app_recovery_ms).len() as f64)?;
                    report.figure(&format!("{prefix}.{c}.attach_latency_ms_mean"), mean(of(|s| s.attach_ms).into_iter()))?;
                    if let Some(k) = clones.iter().position(|x| x == c) {
                        bars[k].values.push(m[i] / 1000.0);
                    }
                }
                report.ratio(&format!("{prefix}.super_vs_plain.app_recovery_latency"), m[1], m[0])?;
                plain_sum += m[0];
                super_sum += m[1];
                if clones.contains(&"general") {
                    report.ratio(&format!("{prefix}.general_vs_plain.app_recovery_latency"), m[2], m[0])?;
                    general_sum += m[2];
                }
                groups.push(format!("{} {} {}", app.name(), wal.trim_end_matches("_wal"), failure));
            }
        }
    }
    // Where start → healthy went, per volume kind, over every sample that has a breakdown.
    for c in CLONES {
        let parts: Vec<[f64; 10]> = samples.iter().filter(|s| s.clone == c).filter_map(|s| s.parts.as_ref().map(Breakdown::values)).collect();
        if !parts.is_empty() {
            for (k, name) in super::breakdown::PARTS.iter().enumerate() {
                report.figure(&format!("{c}.recovery.{name}_ms_mean"), mean(parts.iter().map(|p| p[k])))?;
            }
        }
    }
    // Over every cell: total (of the cells' medians) recovery time on super (general) against
    // the plain volume.
    report.ratio("super_vs_plain.app_recovery_latency", super_sum, plain_sum)?;
    if clones.contains(&"general") {
        report.ratio("general_vs_plain.app_recovery_latency", general_sum, plain_sum)?;
    }
    let group_refs: Vec<&str> = groups.iter().map(String::as_str).collect();
    let _ = bench::bar_plot(&out.join("recovery"), "Application recovery latency (SpecREDS §6.3)", "application, WAL, failure", "seconds", &group_refs, &bars);
    let rows = samples.iter().map(|s| {
        vec![s.app.name().to_string(), s.wal.into(), s.failure.into(), s.clone.into(), s.wal_bytes.to_string(), format!("{:.1}", s.attach_ms), format!("{:.1}", s.app_recovery_ms)]
    });
    bench::write_csv(&out.join("recovery.csv"), &["app", "wal", "failure", "volume", "wal_bytes", "attach_ms", "app_recovery_ms"], rows)?;
    eprintln!("plots and samples in {}", out.display());
    Ok(report)
}
