//! Client commands: `volume create|list|info|delete|resize|super|collapse|clone-general` and
//! `status`. Results go to stdout (one value where a script wants one: the child's name,
//! `promoted` / `rejected`); a human note may go to stderr.

use std::time::Instant;

use clap::Args;
use volume::driver::client::Cluster;
use volume::driver::meta::{Job, Layout, MetaReq, MetaResp, VolumeRec, DEFAULT_OBJECT_SIZE_BYTES};
use volume::types::{CollapseOutcome, ShardState, MAX_OBJECT_SIZE_BYTES};


/// How long `volume collapse` keeps asking through broken connections and an unanswering
/// tracking shard (the metadata service decides on its own meanwhile).
const COLLAPSE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(120);
use crate::size::{format_size, parse_size};
use crate::{ConnArgs, VolumeCmd};

/// Largest volume the CLI creates. The metadata service sets no bound of its own; this keeps
/// object numbers and sizes far from any overflow and catches typos like `--size 1P`.
pub const MAX_VOLUME_SIZE_BYTES: u64 = 64 << 40;

fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s)
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    pub name: String,
    /// Size of the volume (e.g. 1G); a multiple of 512 bytes, at most 64 TiB.
    #[arg(long, value_parser = parse_size_arg)]
    pub size: u64,
    /// Object size: a power of two from 4K to 4M [default: 64K, the paper's sweet spot for
    /// databases].
    #[arg(long, value_parser = parse_size_arg)]
    pub object_size: Option<u64>,
    #[command(flatten)]
    pub conn: crate::VolumeConn,
}

#[derive(Args, Debug)]
pub struct ResizeArgs {
    pub name: String,
    /// New size (e.g. 2G); not smaller than the current one.
    #[arg(long, value_parser = parse_size_arg)]
    pub size: u64,
    #[command(flatten)]
    pub conn: crate::VolumeConn,
}

#[derive(Args, Debug)]
pub struct SuperArgs {
    pub parent: String,
    /// Name of the child [default: PARENT.super-N, the smallest unused N].
    #[arg(long)]
    pub child: Option<String>,
    #[command(flatten)]
    pub conn: crate::VolumeConn,
}

fn check_size(size: u64) -> anyhow::Result<()> {
    anyhow::ensure!(size > 0, "the size must not be zero");
    anyhow::ensure!(
        size <= MAX_VOLUME_SIZE_BYTES,
        "{} is larger than the largest volume, {}",
        format_size(size),
        format_size(MAX_VOLUME_SIZE_BYTES)
    );
    anyhow::ensure!(size.is_multiple_of(512), "the size must be a multiple of 512 bytes, not {size}");
    Ok(())
}

async fn volumes(c: &Cluster) -> anyhow::Result<Vec<VolumeRec>> {
    match c.meta(MetaReq::List).await? {
        MetaResp::Volumes(v) => Ok(v),
        other => anyhow::bail!("unexpected answer from the metadata service: {other:?}"),
    }
}

fn expect_volume(resp: MetaResp) -> anyhow::Result<VolumeRec> {
    match resp {
        MetaResp::Volume(v) => Ok(v),
        other => anyhow::bail!("unexpected answer from the metadata service: {other:?}"),
    }
}

fn kind(v: &VolumeRec) -> String {
    match (&v.layout, &v.super_parent, &v.super_child) {
        (Layout::GeneralClone { parent }, _, _) => format!("general clone of volume id {}", parent.id),
        (_, Some(p), _) => format!("super child of {p}"),
        (_, None, Some(c)) => format!("super parent of {c}"),
        _ if v.vol.parent.is_some() => "promoted child (garbage collection running)".to_string(),
        _ => "plain".to_string(),
    }
}

/// The smallest unused `PARENT.super-N`.
pub fn default_child_name(parent: &str, existing: &[VolumeRec]) -> String {
    (1..).map(|n| format!("{parent}.super-{n}")).find(|name| !existing.iter().any(|v| &v.name == name)).expect("some N is free")
}

pub async fn run(conn: &ConnArgs, cmd: VolumeCmd) -> anyhow::Result<()> {
    let target = conn.target()?;
    let c = target.connect().await?;
    match cmd {
        VolumeCmd::Create(a) => {
            check_size(a.size)?;
            let object_size = a.object_size.unwrap_or(DEFAULT_OBJECT_SIZE_BYTES as u64);
            anyhow::ensure!(
                object_size.is_power_of_two() && (4096..=MAX_OBJECT_SIZE_BYTES as u64).contains(&object_size),
                "--object-size must be a power of two from 4K to 4M, not {}",
                format_size(object_size)
            );
            let v = expect_volume(
                c.meta(MetaReq::Create { name: a.name.clone(), size_bytes: a.size, object_size_bytes: object_size as u32 }).await?,
            )?;
            println!("created {} ({}, objects of {})", v.name, format_size(v.size_bytes), format_size(v.vol.object_size_bytes as u64));
            if let Some(info) = &target.info {
                eprintln!(
                    "attach it: qemu-io -f raw {}   or   understudy volume attach {} --mount DIR --mkfs",
                    info.nbd_uri(&v.name),
                    v.name
                );
            }
        }
        VolumeCmd::List { json, .. } => {
            let vs = volumes(&c).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&vs)?);
            } else if vs.is_empty() {
                println!("no volumes (create one: understudy volume create NAME --size 1G)");
            } else {
                let w = vs.iter().map(|v| v.name.len()).max().unwrap_or(4).max(4);
                println!("{:<w$}  {:>10}  {:>8}  {:>5}  KIND", "NAME", "SIZE", "OBJECT", "ID");
                for v in &vs {
                    println!(
                        "{:<w$}  {:>10}  {:>8}  {:>5}  {}",
                        v.name,
                        format_size(v.size_bytes),
                        format_size(v.vol.object_size_bytes as u64),
                        v.vol.id,
                        kind(v)
                    );
                }
            }
        }
        VolumeCmd::Info { name, json, .. } => {
            let v = c.volume_info(&name).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!("name         {}", v.name);
                println!("size         {} ({} bytes)", format_size(v.size_bytes), v.size_bytes);
                println!("object size  {}", format_size(v.vol.object_size_bytes as u64));
                println!("id           {}", v.vol.id);
                println!("table        {}", v.vol.table);
                println!("kind         {}", kind(&v));
                if let Some(info) = &target.info {
                    println!("nbd          {}", info.nbd_uri(&v.name));
                }
            }
        }
        VolumeCmd::Delete { name, .. } => {
            c.meta(MetaReq::Delete { name: name.clone() }).await?;
            println!("deleted {name} (its objects are removed in the background)");
        }
        VolumeCmd::Resize(a) => {
            check_size(a.size)?;
            let v = expect_volume(c.meta(MetaReq::Resize { name: a.name.clone(), size_bytes: a.size }).await?)?;
            println!("{} is now {}", v.name, format_size(v.size_bytes));
        }
        VolumeCmd::Super(a) => {
            let child = match a.child {
                Some(n) => n,
                None => default_child_name(&a.parent, &volumes(&c).await?),
            };
            let t = Instant::now();
            let v = expect_volume(c.meta(MetaReq::Super { parent: a.parent.clone(), child: child.clone() }).await?)?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            println!("{}", v.name);
            eprintln!("super {} → {} in {ms:.1} ms; `understudy volume collapse {}` decides which survives", a.parent, v.name, v.name);
        }
        VolumeCmd::Collapse { child, .. } => {
            // A repeated collapse of a rejected child finds no volume: the collapse answers.
            let parent = c.volume_info(&child).await.ok().and_then(|i| i.super_parent).unwrap_or_else(|| "the parent".into());
            let t = Instant::now();
            let resp = c.collapse(&child, COLLAPSE_PATIENCE).await?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let MetaResp::Collapsed { outcome, .. } = resp else {
                anyhow::bail!("unexpected answer from the metadata service: {resp:?}");
            };
            match outcome {
                CollapseOutcome::Promoted => {
                    println!("promoted");
                    eprintln!("collapse in {ms:.1} ms: {parent} was not written after super; {child} is the volume now and writes to {parent} fail");
                }
                CollapseOutcome::Rejected => {
                    println!("rejected");
                    eprintln!("collapse in {ms:.1} ms: {parent} was written after super; {child} is discarded and {parent} goes on");
                }
            }
        }
        VolumeCmd::CloneGeneral { parent, child, .. } => {
            let v = expect_volume(c.meta(MetaReq::CloneGeneral { parent: parent.clone(), child: child.clone() }).await?)?;
            println!("{}", v.name);
            eprintln!("general clone {parent} → {} (the rbd-style baseline)", v.name);
        }
        VolumeCmd::Attach(_)
        | VolumeCmd::Detach(_)
        | VolumeCmd::Up(_)
        | VolumeCmd::Meta(_)
        | VolumeCmd::Shard(_)
        | VolumeCmd::Nbd(_)
        | VolumeCmd::Status { .. } => unreachable!("handled in main (run_volume)"),
    }
    Ok(())
}

fn job_text(j: &Job) -> String {
    match j {
        Job::Gc { parent, child, promoted, child_name, .. } => format!(
            "garbage collection after collapse: parent id {parent}, child id {child}{} ({})",
            child_name.as_ref().map(|n| format!(" ({n})")).unwrap_or_default(),
            if *promoted { "promoted" } else { "rejected" }
        ),
        Job::Delete { owner, .. } => format!("deleting the objects of volume id {owner}"),
    }
}

pub async fn status(conn: &ConnArgs, json: bool) -> anyhow::Result<()> {
    let target = conn.target()?;
    let c = target.connect().await?;
    c.refresh_map(c.map().epoch).await?;
    let map = c.map();
    let jobs = match c.meta(MetaReq::Jobs).await? {
        MetaResp::Jobs(j) => j,
        other => anyhow::bail!("unexpected answer from the metadata service: {other:?}"),
    };
    let vols = volumes(&c).await?;
    if json {
        let v = serde_json::json!({
            "meta": target.meta_addr,
            "map": &*map,
            "jobs": jobs,
            "volumes": vols.len(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let up = map.shards.iter().filter(|s| s.state == ShardState::Up).count();
    println!("metadata service  {}", target.meta_addr);
    println!("cluster map       epoch {}, {} replicas, {up}/{} shards up", map.epoch, map.replicas, map.shards.len());
    println!("  {:<6} {:<11} ADDRESS", "SHARD", "STATE");
    for s in &map.shards {
        let state = match s.state {
            ShardState::Up => "up",
            ShardState::Recovering => "recovering",
            ShardState::Down => "down",
        };
        println!("  {:<6} {:<11} {}", s.id, state, s.addr);
    }
    println!("volumes           {}", vols.len());
    if jobs.is_empty() {
        println!("jobs              none");
    } else {
        println!("jobs              {} in progress", jobs.len());
        for j in &jobs {
            println!("  {}", job_text(j));
        }
    }
    Ok(())
}
