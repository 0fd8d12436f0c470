//! `understudy demo`: speculative recovery on a throw-away local cluster, as a timeline.
//!
//! Round 1 (the primary stayed silent): a volume is written through qemu-io over NBD, `super`
//! makes a child, a "recovering application" writes to the child, `collapse` promotes it; reads
//! show the child holds the parent's data plus its own writes, and the old primary's next write
//! fails. Round 2 (the primary was alive after all): after `super` the parent keeps writing,
//! `collapse` rejects the child, and the parent keeps its writes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use volume::driver::client::Cluster;
use volume::driver::meta::{MetaReq, MetaResp};
use volume::types::CollapseOutcome;

use testbed::qemu::{self, Session};
use crate::size::format_size;
use testbed::volume::{LocalCluster, UpConfig, READY_TIMEOUT};

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Keep the cluster's directory (data and logs) instead of deleting it at the end.
    #[arg(long)]
    pub keep: bool,
    /// Storage shards to start.
    #[arg(long, default_value_t = 4)]
    pub shards: u32,
    /// Skip the second part: a real speculative failover of SQLite (`understudy failover demo`).
    #[arg(long)]
    pub no_failover: bool,
    /// The application of the failover part: sqlite (works on a fresh machine) or postgres
    /// (Debian's postgresql).
    #[arg(long, value_enum, default_value_t = crate::failover::DemoApp::Sqlite)]
    pub app: crate::failover::DemoApp,
}

const VOLUME: &str = "app";
const VOLUME_BYTES: u64 = 64 << 20;
const OBJECT_BYTES: u32 = 64 << 10;
/// How long the demo waits for garbage collection after a collapse.
const GC_TIMEOUT: Duration = Duration::from_secs(60);

struct Timeline {
    start: Instant,
    checks: Vec<(String, bool)>,
}

impl Timeline {
    fn event(&self, text: impl AsRef<str>) {
        println!("+{:>6} ms  {}", self.start.elapsed().as_millis(), text.as_ref());
    }

    fn check(&mut self, what: impl Into<String>, held: bool) {
        let what = what.into();
        println!("{:>11}  {} {what}", "", if held { "ok  " } else { "FAIL" });
        self.checks.push((what, held));
    }

    /// Runs a qemu-io command that must succeed, as a check.
    fn io(&mut self, s: &mut Session, cmd: &str, what: &str) -> anyhow::Result<bool> {
        let out = s.cmd(cmd)?;
        if !out.ok {
            println!("{:>11}  qemu-io {cmd}: {}", "", out.text.trim().replace('\n', " | "));
        }
        self.check(what.to_string(), out.ok);
        Ok(out.ok)
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

async fn meta(c: &Cluster, req: MetaReq) -> anyhow::Result<MetaResp> {
    c.meta(req).await
}

async fn volume_names(c: &Cluster) -> anyhow::Result<Vec<String>> {
    match meta(c, MetaReq::List).await? {
        MetaResp::Volumes(v) => Ok(v.into_iter().map(|v| v.name).collect()),
        other => anyhow::bail!("unexpected answer {other:?}"),
    }
}

async fn wait_gc(c: &Cluster, child: &str) -> anyhow::Result<bool> {
    let deadline = Instant::now() + GC_TIMEOUT;
    while Instant::now() < deadline {
        let jobs_left = matches!(meta(c, MetaReq::Jobs).await?, MetaResp::Jobs(j) if !j.is_empty());
        let child_done = c.volume_info(child).await.map(|v| v.vol.parent.is_none()).unwrap_or(true);
        if !jobs_left && child_done {
            return Ok(true);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(false)
}

pub fn demo(a: DemoArgs, verbose: u8) -> anyhow::Result<()> {
    qemu::check_installed()?;
    let dir = tempfile::Builder::new().prefix("understudy-demo-").tempdir().context("cannot create a temporary directory")?;
    let dir_path: PathBuf = dir.path().to_path_buf();
    let rt = crate::runtime()?;
    let mut tl = Timeline { start: Instant::now(), checks: vec![] };
    println!("Understudy demo: speculative recovery with super and collapse (data in {})", dir_path.display());
    let mut lc =
        LocalCluster::start(&UpConfig { dir: dir_path.clone(), shards: a.shards, replicas: 3.min(a.shards), port_base: 0, verbose })?;
    // Ctrl-C: stop the children and remove the directory, then leave.
    {
        let pids: Vec<u32> =
            std::iter::once(lc.info.meta.pid).chain(lc.info.shards.iter().map(|s| s.pid)).chain(std::iter::once(lc.info.nbd.pid)).collect();
        let (d, keep) = (dir_path.clone(), a.keep);
        rt.spawn(async move {
            let sig = testbed::proc::shutdown_signal().await;
            eprintln!("demo: {sig} received, stopping");
            for p in &pids {
                testbed::proc::signal(*p, libc::SIGTERM);
            }
            std::thread::sleep(Duration::from_millis(500));
            if !keep {
                let _ = std::fs::remove_dir_all(&d);
            }
            std::process::exit(130);
        });
    }
    let result = rt.block_on(lc.wait_ready(READY_TIMEOUT, false)).and_then(|cluster| {
        let info = lc.info.clone();
        tl.event(format!(
            "cluster up: metadata {}, {} shards x {} replicas, NBD nbd://{}/<volume>",
            info.meta.addr,
            info.shards.len(),
            info.replicas,
            info.nbd.addr
        ));
        script(&mut tl, &rt, &cluster, &info)
    });
    lc.stop();
    tl.event("cluster stopped");
    if a.keep {
        let kept = dir.keep();
        println!("kept {}", kept.display());
    } else {
        drop(dir);
        tl.event(format!("removed {}", dir_path.display()));
    }
    result?;
    let failed: Vec<&str> = tl.checks.iter().filter(|(_, ok)| !ok).map(|(w, _)| w.as_str()).collect();
    if failed.is_empty() {
        println!("all {} checks held", tl.checks.len());
        drop(rt);
        if !a.no_failover {
            println!();
            crate::failover::demo(verbose, a.app)?;
        }
        Ok(())
    } else {
        anyhow::bail!("{} of {} checks failed: {}", failed.len(), tl.checks.len(), failed.join("; "))
    }
}

fn collapse(rt: &tokio::runtime::Runtime, c: &Cluster, child: &str) -> anyhow::Result<(CollapseOutcome, Duration)> {
    let t = Instant::now();
    match rt.block_on(meta(c, MetaReq::Collapse { child: child.into() }))? {
        MetaResp::Collapsed { outcome, .. } => Ok((outcome, t.elapsed())),
        other => anyhow::bail!("collapse gave an unexpected answer: {other:?}"),
    }
}

fn do_super(rt: &tokio::runtime::Runtime, c: &Cluster, parent: &str, child: &str) -> anyhow::Result<Duration> {
    let t = Instant::now();
    rt.block_on(meta(c, MetaReq::Super { parent: parent.into(), child: child.into() }))?;
    Ok(t.elapsed())
}

fn script(
    tl: &mut Timeline,
    rt: &tokio::runtime::Runtime,
    c: &Arc<Cluster>,
    info: &testbed::cluster_file::ClusterInfo,
) -> anyhow::Result<()> {
    let uri = |v: &str| info.nbd_uri(v);

    // ---- set-up -------------------------------------------------------------------------
    rt.block_on(meta(c, MetaReq::Create { name: VOLUME.into(), size_bytes: VOLUME_BYTES, object_size_bytes: OBJECT_BYTES }))?;
    tl.event(format!("created volume {VOLUME} ({}, objects of {})", format_size(VOLUME_BYTES), format_size(OBJECT_BYTES as u64)));
    let mut primary = Session::open(&uri(VOLUME))?;
    let a1 = primary.cmd("write -P 0xa1 0 256k")?;
    let a2 = primary.cmd("write -P 0xa2 1M 64k")?;
    tl.event(format!("{VOLUME}: the primary writes 0xa1 over [0, 256K) and 0xa2 over [1M, +64K) (qemu-io over NBD)"));
    tl.check("the primary's writes succeed", a1.ok && a2.ok);
    tl.event(format!("{VOLUME}: the primary stops answering; a monitor suspects it failed"));

    // ---- round 1: the parent stays silent -> promoted --------------------------------------
    println!("--- round 1: the primary stays silent while a backup recovers");
    let child1 = format!("{VOLUME}.super-1");
    let d = do_super(rt, c, VOLUME, &child1)?;
    tl.event(format!("super {VOLUME} → {child1} (O(1): {})", ms(d)));

    let mut rec = Session::open(&uri(&child1))?;
    tl.event(format!("{child1}: the backup opens the clone and recovers on it"));
    tl.io(&mut rec, "read -P 0xa1 0 64k", &format!("{child1} reads the parent's data (shared allocation table)"))?;
    let w1 = rec.cmd("write -P 0xc1 64k 4k")?;
    tl.event(format!("{child1}: writes 0xc1 at [64K, +4K) (copy-on-write: a local copy on each shard)"));
    let w2 = rec.cmd("write -P 0xc2 128k 64k")?;
    let w3 = rec.cmd("write -P 0xc3 2M 64k")?;
    tl.event(format!("{child1}: writes 0xc2 over [128K, +64K) (a whole object: no copy) and 0xc3 over [2M, +64K)"));
    tl.check(format!("{child1}'s writes succeed"), w1.ok && w2.ok && w3.ok);

    let (outcome, d) = collapse(rt, c, &child1)?;
    tl.event(format!("collapse {child1} → {} ({}: one round trip to the tracking shard)", outcome_text(outcome), ms(d)));
    tl.check(format!("{child1} is promoted (the parent stayed clean)"), outcome == CollapseOutcome::Promoted);

    let verify = qemu::run(
        &uri(&child1),
        &[
            "read -P 0xa1 0 64k",
            "read -P 0xc1 64k 4k",
            "read -P 0xa1 68k 60k",
            "read -P 0xc2 128k 64k",
            "read -P 0xa1 192k 64k",
            "read -P 0xa2 1M 64k",
            "read -P 0xc3 2M 64k",
            "read -P 0x00 3M 64k",
        ],
    )?;
    tl.event(format!("{child1}: a fresh qemu-io reads the volume back"));
    if !verify.ok {
        println!("{:>11}  {}", "", verify.text.trim().replace('\n', " | "));
    }
    tl.check(format!("{child1} holds the parent's data plus its own writes"), verify.ok);

    let fenced = primary.cmd("write -P 0xa3 0 4k")?;
    tl.event(format!("{VOLUME}: the old primary comes back and writes: {}", fenced.text.lines().next().unwrap_or("").trim()));
    tl.check("the fenced parent's write fails (EPERM)", !fenced.ok && fenced.text.contains("Operation not permitted"));
    let names = rt.block_on(volume_names(c))?;
    tl.check(
        format!("{VOLUME} is gone from the volume list; {child1} is the volume"),
        !names.contains(&VOLUME.to_string()) && names.contains(&child1),
    );
    primary.close();
    rec.close();
    let t = Instant::now();
    let gc = rt.block_on(wait_gc(c, &child1))?;
    tl.event(format!("garbage collection done in {}: {child1} owns every object, no chain of ancestors", ms(t.elapsed())));
    tl.check("garbage collection finishes", gc);

    // ---- round 2: the parent keeps writing -> rejected ------------------------------------
    println!("--- round 2: the primary was alive after all and keeps writing");
    let parent = child1.clone();
    let child2 = format!("{parent}.super-1");
    let mut primary = Session::open(&uri(&parent))?;
    let d = do_super(rt, c, &parent, &child2)?;
    tl.event(format!("super {parent} → {child2} (O(1): {})", ms(d)));
    let mut rec = Session::open(&uri(&child2))?;
    let o = rec.cmd("write -P 0xd1 0 64k")?;
    tl.event(format!("{child2}: a backup recovers and writes 0xd1 over [0, 64K)"));
    tl.check(format!("{child2}'s write succeeds"), o.ok);
    let o = primary.cmd("write -P 0xb1 256k 4k")?;
    tl.event(format!("{parent}: the primary writes 0xb1 at [256K, +4K): the tracking shard sets the dirty bit"));
    tl.check(format!("{parent}'s write after super succeeds"), o.ok);

    let (outcome, d) = collapse(rt, c, &child2)?;
    tl.event(format!("collapse {child2} → {} ({})", outcome_text(outcome), ms(d)));
    tl.check(format!("{child2} is rejected (the parent was written)"), outcome == CollapseOutcome::Rejected);

    let kept: Vec<_> = ["read -P 0xb1 256k 4k", "read -P 0xa1 0 64k", "read -P 0xc1 64k 4k"]
        .iter()
        .map(|cmd| primary.cmd(cmd))
        .collect::<anyhow::Result<_>>()?;
    let more = primary.cmd("write -P 0xb2 260k 4k")?;
    let more_back = primary.cmd("read -P 0xb2 260k 4k")?;
    tl.event(format!("{parent}: reads back its own data and keeps writing"));
    tl.check(format!("{parent} keeps its writes and none of the child's"), kept.iter().all(|o| o.ok));
    tl.check(format!("{parent} is still writable"), more.ok && more_back.ok);
    let names = rt.block_on(volume_names(c))?;
    tl.check(format!("{child2} is discarded"), !names.contains(&child2));
    let reopen = Session::open(&uri(&child2));
    tl.check(format!("{child2} can no longer be opened over NBD"), reopen.is_err());
    primary.close();
    rec.close();
    let t = Instant::now();
    let gc = rt.block_on(wait_gc(c, &parent))?;
    tl.event(format!("garbage collection of {child2} done in {}", ms(t.elapsed())));
    tl.check("garbage collection finishes", gc);
    Ok(())
}

fn outcome_text(o: CollapseOutcome) -> &'static str {
    match o {
        CollapseOutcome::Promoted => "promoted",
        CollapseOutcome::Rejected => "rejected",
    }
}
