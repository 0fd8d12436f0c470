//! A log peer's host lost (issue 24 item 8): its files are fully re-replicated within 2× the
//! peer lease plus the copy time of its bytes at disk speed.
//!
//! On a fresh [`HostBed`] with its nearlog cluster (a controller and a peer per server host),
//! [`FILES`] log files of [`FILE_BYTES`] each are written on the three peers (3 replicas,
//! based and initialized as the shim's first open does), then a spare peer is started on the
//! client host (after the writes, so no file is placed on it), then a server host that does
//! not hold the controller leader dies. Timed from the kill until the leader's status shows
//! every file off the lost peer with its move complete (a Base committed on the new set) and
//! the spare reporting at least the files' bytes held (its heartbeat: the copy is whole).
//!
//! The bound is computed from the run's own figures: 2 × the peer lease, plus the files' bytes
//! over the disk speed measured on the bed's directory just before (sequential writes of
//! [`DISK_PROBE_BYTES`], then fsync).

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use nearlog::core::file_client::{ClientConfig, FileClient};
use nearlog::driver::mover::{ctl_call, Driver};
use nearlog::proto::{ControllerState, CtlReply, CtlRequest, PeerId};
use testbed::hostbed::{
    HostBed, CLIENT_HOST, NEARLOG_PEER_LEASE_MS, NEARLOG_REGION_BYTES, SERVER_HOSTS,
};

use super::{failed, figure_spread, load, ms};

/// Log files written before the loss, and each one's size: together a quarter of a peer's
/// region, so the spare takes them all with room to spare.
pub const FILES: usize = 4;
pub const FILE_BYTES: usize = 4 << 20;
/// Written and fsynced to measure the disk's speed.
pub const DISK_PROBE_BYTES: usize = 64 << 20;
/// Bound of every wait before the kill (etcd, a leader, live peers, a file's writes).
pub const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// After the kill, how long the re-replication may take before the run is reported failed.
pub const REREPLICATION_TIMEOUT: Duration = Duration::from_secs(90);

/// 2 × the peer lease plus the copy of `bytes` at `disk_bytes_per_s`, in ms.
pub fn bound_ms(peer_lease_ms: u64, bytes: u64, disk_bytes_per_s: f64) -> f64 {
    2.0 * peer_lease_ms as f64 + bytes as f64 / disk_bytes_per_s * 1e3
}

/// One run's figures.
struct Run {
    rereplicated: Duration,
    moved: Duration,
    bytes: u64,
    disk_bytes_per_s: f64,
    load: String,
}

/// Measures `reps` losses; returns the CSV rows (part, rep, what, value, load).
pub(super) fn measure(
    reps: usize,
    report: &mut bench::Report,
    failures: &mut Vec<String>,
) -> anyhow::Result<Vec<Vec<String>>> {
    let mut rows = vec![];
    let (mut took, mut bounds, mut moved) = (vec![], vec![], vec![]);
    for rep in 0..reps {
        eprintln!("log peer's host loss {}/{reps}", rep + 1);
        match one() {
            Ok(r) => {
                let bound = bound_ms(NEARLOG_PEER_LEASE_MS, r.bytes, r.disk_bytes_per_s);
                eprintln!(
                    "log peer's host lost: {} bytes re-replicated {:.0} ms after (moves recorded {:.0} ms after); bound {bound:.0} ms \
                     (2 × {NEARLOG_PEER_LEASE_MS} ms lease + bytes at {:.0} MiB/s); load {}",
                    r.bytes,
                    ms(r.rereplicated),
                    ms(r.moved),
                    r.disk_bytes_per_s / (1 << 20) as f64,
                    r.load
                );
                for (what, v) in [
                    ("rereplicated_ms", ms(r.rereplicated)),
                    ("moved_ms", ms(r.moved)),
                    ("bound_ms", bound),
                    ("disk_bytes_per_s", r.disk_bytes_per_s),
                ] {
                    rows.push(vec![
                        "nearlog_peer".into(),
                        rep.to_string(),
                        what.into(),
                        format!("{v:.1}"),
                        r.load.clone(),
                    ]);
                }
                took.push(ms(r.rereplicated));
                moved.push(ms(r.moved));
                bounds.push(bound);
                report.figure("nearlog.host_loss.rereplicated_bytes", r.bytes as f64)?;
            }
            Err(e) => failed(failures, &format!("nearlog_peer repetition {rep}"), e),
        }
    }
    if !took.is_empty() {
        let t = figure_spread(report, "nearlog.host_loss.rereplicated_ms", &took)?;
        figure_spread(report, "nearlog.host_loss.moves_recorded_ms", &moved)?;
        let b = figure_spread(report, "nearlog.host_loss.rereplication_bound_ms", &bounds)?;
        report.ratio("nearlog.host_loss.rereplicated_vs_bound", t, b)?;
    }
    Ok(rows)
}

/// Sequential write of [`DISK_PROBE_BYTES`] to a file in `dir`, then fsync: bytes per second.
fn disk_speed(dir: &std::path::Path) -> anyhow::Result<f64> {
    let path = dir.join("disk-probe");
    let chunk = vec![0x5au8; 1 << 20];
    let t0 = Instant::now();
    let mut f = std::fs::File::create(&path)?;
    for _ in 0..DISK_PROBE_BYTES / chunk.len() {
        f.write_all(&chunk)?;
    }
    f.sync_all()?;
    let took = t0.elapsed();
    drop(f);
    std::fs::remove_file(&path)?;
    Ok(DISK_PROBE_BYTES as f64 / took.as_secs_f64())
}

fn status(controllers: &str, secret: &[u8]) -> Option<ControllerState> {
    match ctl_call(controllers, secret, &CtlRequest::Status) {
        Ok(CtlReply::Status(st)) => Some(st),
        _ => None,
    }
}

/// Waits until `f` holds of the leader's status; returns it.
fn wait_status(
    controllers: &str,
    secret: &[u8],
    timeout: Duration,
    what: &str,
    f: impl Fn(&ControllerState) -> bool,
) -> anyhow::Result<ControllerState> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(st) = status(controllers, secret) {
            if f(&st) {
                return Ok(st);
            }
        }
        ensure!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes log file `key` of `bytes` bytes on 3 peers: placed, based on its content, initialized,
/// every replica caught up.
fn write_file(
    controllers: &str,
    secret: &[u8],
    key: &str,
    bytes: usize,
) -> anyhow::Result<Vec<PeerId>> {
    let g = match ctl_call(
        controllers,
        secret,
        &CtlRequest::Open {
            key: key.into(),
            replicas: 3,
        },
    )
    .map_err(anyhow::Error::msg)?
    {
        CtlReply::Granted(g) => g,
        other => bail!("opening {key}: {other:?}"),
    };
    let peers: Vec<PeerId> = g.peers.iter().map(|p| p.id).collect();
    let image: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
    let mut d = Driver::new(secret);
    d.learn(&g);
    let mut c = FileClient::open(
        g.file,
        g.epoch,
        peers.clone(),
        g.initialized,
        image,
        ClientConfig::default(),
        d.now_us(),
    );
    let deadline = Instant::now() + READY_TIMEOUT;
    d.run(&mut c, deadline, |c| c.is_ready())
        .map_err(|e| anyhow::anyhow!("writing {key}: {e}"))?;
    ctl_call(
        controllers,
        secret,
        &CtlRequest::Initialized {
            key: key.into(),
            epoch: g.epoch,
        },
    )
    .map_err(anyhow::Error::msg)?;
    d.run(&mut c, deadline, |c| c.fully_replicated())
        .map_err(|e| anyhow::anyhow!("replicating {key}: {e}"))?;
    Ok(peers)
}

fn one() -> anyhow::Result<Run> {
    testbed::hosts::available()?;
    let bed = HostBed::start(&std::env::current_exe()?)?;
    bed.in_client(|| -> anyhow::Result<Run> {
        let sys = bed.start_nearlog()?;
        let controllers = sys.controllers.join(",");
        let secret = bed.secret();
        wait_status(
            &controllers,
            secret,
            READY_TIMEOUT,
            "3 live peers at a leader",
            |st| st.peers.values().filter(|p| p.live).count() == SERVER_HOSTS,
        )?;
        let disk_bytes_per_s = disk_speed(bed.dir())?;
        for i in 0..FILES {
            let peers = write_file(
                &controllers,
                secret,
                &format!("/cbench/f{i}.log"),
                FILE_BYTES,
            )?;
            ensure!(peers.len() == 3, "f{i} placed on {peers:?}");
        }
        // The spare, on the client host (never killed), after the writes: nothing is on it.
        let spare_addr = format!(
            "{}:{}",
            bed.client().addr(),
            wire::ports::free_loopback_port()?
        );
        let args: Vec<String> = [
            "nearlog",
            "peer",
            "--listen",
            &spare_addr,
            "--controller",
            &controllers,
            "--region-bytes",
            &NEARLOG_REGION_BYTES.to_string(),
            "--secret-file",
            &bed.secret_file().display().to_string(),
            "--id-file",
            &bed.dir().join("nl-peer-spare.id").display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        bed.spawn(CLIENT_HOST, "nl-peer-spare", &args)?;
        let st = wait_status(
            &controllers,
            secret,
            READY_TIMEOUT,
            "the spare peer live",
            |st| st.peers.values().filter(|p| p.live).count() == SERVER_HOSTS + 1,
        )?;
        let spare = *st
            .peers
            .iter()
            .find(|(_, p)| p.addr == spare_addr)
            .context("the spare is not registered")?
            .0;
        // A server host whose controller does not lead (the leader is the one that answers).
        let leader = sys
            .controllers
            .iter()
            .find(|c| nearlog::driver::blocking::connect(c, secret, Duration::from_secs(1)).is_ok())
            .context("no controller leads")?;
        let leader_host = bed.host_of(leader).context("the leader's host")?;
        let lost_host = (0..SERVER_HOSTS)
            .find(|h| *h != leader_host)
            .context("no other host")?;
        let lost = *st
            .peers
            .iter()
            .find(|(_, p)| p.addr == sys.peers[lost_host])
            .context("the lost peer is not registered")?
            .0;
        let bytes: u64 = st
            .files
            .values()
            .filter(|m| m.peers.contains(&lost))
            .count() as u64
            * FILE_BYTES as u64;
        ensure!(bytes > 0, "no file on peer {lost}: {st:?}");

        let load = load();
        let killed = Instant::now();
        bed.kill_host(lost_host)?;
        let off_lost = |st: &ControllerState| {
            st.files
                .values()
                .all(|m| !m.peers.contains(&lost) && m.prev_peers.is_empty())
        };
        wait_status(
            &controllers,
            secret,
            REREPLICATION_TIMEOUT,
            "every file's move off the lost peer",
            off_lost,
        )?;
        let moved = killed.elapsed();
        wait_status(
            &controllers,
            secret,
            REREPLICATION_TIMEOUT.saturating_sub(moved),
            "the spare holding the files' bytes",
            |st| off_lost(st) && st.peers.get(&spare).is_some_and(|p| p.used_bytes >= bytes),
        )?;
        let rereplicated = killed.elapsed();
        Ok(Run {
            rereplicated,
            moved,
            bytes,
            disk_bytes_per_s,
            load,
        })
    })?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_is_two_leases_plus_the_copy_at_disk_speed() {
        assert_eq!(bound_ms(2000, 0, 1e6), 4000.0);
        assert_eq!(bound_ms(2000, 100 << 20, (100 << 20) as f64), 5000.0);
        assert_eq!(bound_ms(5000, 1 << 20, (2 << 20) as f64), 10_500.0);
    }
}
