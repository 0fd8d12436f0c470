//! The runtime driver of a shard: real sockets, real files, a real clock, around [`ShardCore`].
//!
//! One task owns the core and feeds it inputs from a bounded channel: messages read by the
//! connection tasks, completed disk commands (run on tokio's blocking pool so many fdatasyncs
//! proceed in parallel), and clock ticks. Outputs go to per-connection writer tasks, also through
//! bounded channels; a message that cannot be queued is dropped and the core's resend timer or
//! the client's retry covers it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::io::BufWriter;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use std::sync::atomic::{AtomicU64, Ordering};

use wire::metrics::metric;

use crate::driver::leader::{changed_from, order_addrs, LeaderWatch};
use crate::core::shard::{CoreStats, DiskCmd, Input, LeaseReport, Output, Peer, ShardConfig, ShardCore};
use crate::store::FileStore;
use crate::types::*;

/// Messages waiting for one connection's writer.
pub const CONN_QUEUE_MSGS: usize = 4096;
/// Inputs waiting for the core.
pub const CORE_QUEUE_INPUTS: usize = 8192;
const TICK_INTERVAL_MS: u64 = 20;
/// Disk commands running at once (each on a blocking thread); more wait their turn.
pub const MAX_DISK_COMMANDS_IN_FLIGHT: usize = 64;
/// A disk command that takes longer than this (queueing for a disk slot included) is counted
/// (`understudy_shard_slow_disk_ops_total`); one whose own run took this long is logged (at most
/// once a second): a stall of the disk or the file system shows in the shard's log, not just as
/// a slow I/O.
pub const SLOW_DISK_COMMAND_MS: u64 = 100;

#[derive(Clone, Debug)]
pub struct ShardOptions {
    pub id: ShardId,
    pub listen: SocketAddr,
    /// Address other shards and clients reach this shard at (defaults to `listen`).
    pub advertise: Option<String>,
    pub data_dir: PathBuf,
    pub meta_addr: String,
    pub secret: Vec<u8>,
    pub create: bool,
    /// Where to serve Prometheus metrics, if anywhere.
    pub metrics: Option<SocketAddr>,
    /// Latency added to disk commands, to stand for a slower (cloud) disk in benchmarks.
    pub injected: InjectedLatency,
    /// The store's write-ahead journal ring, in bytes; `None`: no journal (every write syncs
    /// its own slot file). See [`crate::store::PoolOptions::journal_capacity_bytes`].
    pub journal_bytes: Option<u64>,
    /// Keep a liveness lease in the control store and fence on it (`volume shard --store`);
    /// None: liveness by the metadata link alone.
    pub lease: Option<ShardLease>,
}

/// Where and how a shard keeps its liveness lease (issue 24 §3): the registration
/// `live/shard/<id>` in the control store the metadata service runs on.
#[derive(Clone, Debug)]
pub struct ShardLease {
    /// The control store (`etcd://...`): shared with the metadata services.
    pub store_url: String,
    /// The cluster name in the store's keys (the metadata services' `--store-cluster`).
    pub cluster: String,
    /// The cluster's identity (from the secret, as the metadata service derives it).
    pub cluster_id: String,
    /// The lease's TTL: the shard is marked down about this long after it stops renewing; it
    /// fences itself a third of it earlier ([`crate::core::shard::Fence`]).
    pub ttl: Duration,
}

/// How often the lease task looks at its registration and reports a change to the core: well
/// under the fencing margin (a third of a TTL of at least a second).
pub const LEASE_REPORT_INTERVAL: Duration = Duration::from_millis(20);
/// The wait before registering again after the store refused or could not be reached.
pub const LEASE_RETRY_INTERVAL: Duration = Duration::from_millis(200);

/// Latency a shard adds to its disk commands before their completion reaches the core (so before
/// it acks), to make this machine's disk look like a cloud disk (e.g. EBS gp3: about 0.5 ms per
/// write, 1 ms per flush). Every mutating command of the store both writes and makes its write
/// durable (the volume has no volatile cache: an ack means durable; with the journal the flush is
/// shared, but the model charges each command as if it were its own), so it pays
/// `write_us + flush_us`; reads pay nothing. The delay is slept on the blocking thread that ran the command, so commands in flight
/// overlap as they would on a real disk with a queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InjectedLatency {
    pub write_us: u64,
    pub flush_us: u64,
}

impl InjectedLatency {
    fn for_cmd(&self, cmd: &DiskCmd) -> Duration {
        match cmd {
            DiskCmd::Read { .. } | DiskCmd::ReadAll { .. } | DiskCmd::Prestock { .. } => Duration::ZERO,
            DiskCmd::Apply { .. } | DiskCmd::Delete { .. } | DiskCmd::Rename { .. } | DiskCmd::SaveState { .. } => {
                Duration::from_micros(self.write_us + self.flush_us)
            }
        }
    }
}

/// Counters of the driver, and the core's gauges as of the last tick.
struct Stats {
    core: std::sync::Mutex<CoreStats>,
    /// Read at each scrape (the store's counters are atomics), so a benchmark that scrapes
    /// right after a batch of writes sees all of them.
    store: Arc<FileStore>,
    messages_in: AtomicU64,
    messages_dropped: AtomicU64,
    disk_ops: AtomicU64,
    disk_errors: AtomicU64,
    slow_disk_ops: AtomicU64,
    /// Time disk commands waited for a disk slot and a blocking thread, summed (µs).
    disk_wait_us: AtomicU64,
    /// Per kind of disk command ([`DISK_KINDS`]): commands run, and their run time summed (µs).
    disk_kind_ops: [AtomicU64; DISK_KINDS.len()],
    disk_kind_run_us: [AtomicU64; DISK_KINDS.len()],
    /// When a slow disk command was last logged, in ms since `started` (0: never).
    slow_logged_ms: AtomicU64,
    started: Instant,
}

impl Stats {
    fn render(&self, shard: ShardId) -> String {
        let c = *self.core.lock().unwrap();
        let mut out = String::new();
        let l = format!("shard=\"{shard}\"");
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        metric(&mut out, "understudy_shard_epoch", "gauge", "Cluster map epoch the shard acts on.", &[(&l, c.epoch as f64)]);
        metric(&mut out, "understudy_shard_objects", "gauge", "Objects stored.", &[(&l, c.objects as f64)]);
        metric(&mut out, "understudy_shard_ops_in_flight", "gauge", "Operations in progress.", &[(&l, c.ops_in_flight as f64)]);
        metric(&mut out, "understudy_shard_locked_slots", "gauge", "Slots with an operation holding their lock.", &[(&l, c.locked_slots as f64)]);
        metric(&mut out, "understudy_shard_recovering", "gauge", "1 while re-replicating.", &[(&l, c.recovering as u8 as f64)]);
        metric(&mut out, "understudy_shard_fenced", "gauge", "1 while fenced: unsure of its lease in the control store, refusing client I/O.", &[(&l, c.fenced as u8 as f64)]);
        metric(&mut out, "understudy_shard_messages_in_total", "counter", "Messages received.", &[(&l, g(&self.messages_in))]);
        metric(&mut out, "understudy_shard_messages_dropped_total", "counter", "Messages dropped because a connection queue was full.", &[(&l, g(&self.messages_dropped))]);
        metric(&mut out, "understudy_shard_disk_ops_total", "counter", "Disk commands run.", &[(&l, g(&self.disk_ops))]);
        metric(&mut out, "understudy_shard_disk_errors_total", "counter", "Disk commands that failed.", &[(&l, g(&self.disk_errors))]);
        let p = self.store.pool_stats();
        let free: Vec<(String, f64)> =
            (0..crate::store::CLASSES).map(|c| (format!("{l},class_bytes=\"{}\"", crate::store::CLASS_DATA_BYTES[c]), p.free_slots[c] as f64)).collect();
        let free: Vec<(&str, f64)> = free.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        metric(&mut out, "understudy_shard_free_slots", "gauge", "Ready slot files per size class (any write may take them).", &free);
        let reserved: Vec<(String, f64)> =
            (0..crate::store::CLASSES).map(|c| (format!("{l},class_bytes=\"{}\"", crate::store::CLASS_DATA_BYTES[c]), p.reserved_free_slots[c] as f64)).collect();
        let reserved: Vec<(&str, f64)> = reserved.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        metric(&mut out, "understudy_shard_reserved_free_slots", "gauge", "Ready slot files set aside for super children's first writes, per size class.", &reserved);
        metric(&mut out, "understudy_shard_slow_allocations_total", "counter", "Writes that found no ready slot and created one.", &[(&l, p.slow_allocations as f64)]);
        metric(&mut out, "understudy_shard_prestocks_total", "counter", "Pre-stocking hints of super handled.", &[(&l, p.prestocks as f64)]);
        metric(&mut out, "understudy_shard_slow_disk_ops_total", "counter", "Disk commands that took longer than SLOW_DISK_COMMAND_MS.", &[(&l, g(&self.slow_disk_ops))]);
        metric(&mut out, "understudy_shard_background_tasks_waiting", "gauge", "Budgeted background tasks (GC) waiting for a turn.", &[(&l, c.background_waiting as f64)]);
        metric(&mut out, "understudy_shard_background_tasks_running", "gauge", "Budgeted background tasks (GC) running.", &[(&l, c.background_running as f64)]);
        metric(&mut out, "understudy_shard_disk_wait_us_total", "counter", "Microseconds disk commands waited for a disk slot and a thread.", &[(&l, g(&self.disk_wait_us))]);
        let by_kind = |a: &[AtomicU64; DISK_KINDS.len()]| -> Vec<(String, f64)> {
            DISK_KINDS.iter().zip(a).map(|(k, v)| (format!("{l},kind=\"{k}\""), g(v))).collect()
        };
        let (ops, run) = (by_kind(&self.disk_kind_ops), by_kind(&self.disk_kind_run_us));
        metric(&mut out, "understudy_shard_disk_kind_ops_total", "counter", "Disk commands run, by kind.", &ops.iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>());
        metric(&mut out, "understudy_shard_disk_kind_run_us_total", "counter", "Microseconds disk commands ran, by kind.", &run.iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>());
        let sc = p.counters;
        let store: [(&str, &str, u64); 14] = [
            ("applies", "Apply commands run.", sc.applies),
            ("cow_first_writes", "First writes of a super child to an object (copy-on-write).", sc.cow_first_writes),
            ("slots_from_pool", "Slots writes took from the free pool.", sc.slots_from_pool),
            ("slots_from_reserve", "Slots first child writes took from the slots set aside for them.", sc.slots_from_reserve),
            ("write_fdatasyncs", "fdatasyncs of mutating commands (not the refill's).", sc.write_fdatasyncs),
            ("write_dir_fsyncs", "Directory fsyncs on a command's path (slots created inline).", sc.write_dir_fsyncs),
            ("cow_load_us", "Microseconds first child writes spent reading the parent object.", sc.cow_load_us),
            ("cow_commit_us", "Microseconds first child writes spent writing and syncing.", sc.cow_commit_us),
            ("in_place_writes", "In-place overwrites.", sc.in_place_writes),
            ("in_place_us", "Microseconds in-place overwrites took.", sc.in_place_us),
            ("refill_slots", "Slots the background refill created.", sc.refill_slots),
            ("refill_batches", "Batches of slots the refill created.", sc.refill_batches),
            ("refill_batches_while_serving", "Refill batches started while the shard served writes.", sc.refill_batches_while_serving),
            ("refill_us", "Microseconds the refill spent creating slots.", sc.refill_us),
        ];
        for (name, help, v) in store {
            metric(&mut out, &format!("understudy_store_{name}_total"), "counter", help, &[(&l, v as f64)]);
        }
        if let Some(j) = self.store.journal_stats() {
            let journal: [(&str, &str, u64); 7] = [
                ("records", "Records appended to the journal (one per durable slot write).", j.records),
                ("record_bytes", "Payload bytes appended to the journal.", j.record_bytes),
                ("syncs", "fdatasyncs of the journal (each acknowledges every record before it).", j.syncs),
                ("checkpoints", "Checkpoints (slot files synced, journal space freed).", j.checkpoints),
                ("checkpoint_files_synced", "Slot files checkpoints synced.", j.checkpoint_files_synced),
                ("checkpoint_us", "Microseconds checkpoints took.", j.checkpoint_us),
                ("full_waits", "Appends that waited for a checkpoint to free journal space.", j.full_waits),
            ];
            for (name, help, v) in journal {
                metric(&mut out, &format!("understudy_journal_{name}_total"), "counter", help, &[(&l, v as f64)]);
            }
        }
        out
    }
}

enum CoreEvent {
    Input(Input),
    ClientConn(u64, mpsc::Sender<Msg>),
    ClientGone(u64),
    PeerGone(ShardId),
    MetaConn(mpsc::Sender<Msg>),
}

/// Runs a shard until the process is stopped.
pub async fn run_shard(opts: ShardOptions) -> anyhow::Result<()> {
    let pool = crate::store::PoolOptions { journal_capacity_bytes: opts.journal_bytes, ..Default::default() };
    let store = Arc::new(FileStore::open_with(&opts.data_dir, opts.create, pool).map_err(anyhow::Error::msg)?);
    let boot = {
        let s = store.clone();
        tokio::task::spawn_blocking(move || s.boot()).await?.context("reading the shard's objects")?
    };
    tracing::info!(shard = opts.id, objects = boot.objects.len(), "shard starting");
    let boot_is_empty = boot.objects.is_empty();
    let listener = TcpListener::bind(opts.listen).await.with_context(|| format!("cannot listen on {}", opts.listen))?;
    let advertise = opts.advertise.clone().unwrap_or_else(|| listener.local_addr().unwrap().to_string());
    let mut cfg = ShardConfig::new(opts.id);
    cfg.id_base = rand::random::<u64>() >> 16;
    cfg.lease_required = opts.lease.is_some();
    // The core's clock (monotonic, µs since this instant); the lease task reports on it too.
    let start = Instant::now();
    let core = ShardCore::new(cfg, boot);
    let (tx, rx) = mpsc::channel::<CoreEvent>(CORE_QUEUE_INPUTS);
    let secret: Arc<[u8]> = opts.secret.clone().into();
    let stats = Arc::new(Stats {
        core: Default::default(),
        store: store.clone(),
        messages_in: Default::default(),
        messages_dropped: Default::default(),
        disk_ops: Default::default(),
        disk_errors: Default::default(),
        slow_disk_ops: Default::default(),
        disk_wait_us: Default::default(),
        disk_kind_ops: Default::default(),
        disk_kind_run_us: Default::default(),
        slow_logged_ms: Default::default(),
        started: Instant::now(),
    });
    if let Some(addr) = opts.metrics {
        let l = TcpListener::bind(addr).await.with_context(|| format!("cannot serve metrics on {addr}"))?;
        let (stats, id) = (stats.clone(), opts.id);
        tokio::spawn(wire::metrics::serve(l, move || {
            let stats = stats.clone();
            async move { stats.render(id) }
        }));
    }

    // Accept clients and peers.
    {
        let tx = tx.clone();
        let secret = secret.clone();
        let next_conn = std::sync::atomic::AtomicU64::new(1);
        tokio::spawn(wire::listen::serve(listener, format!("shard {}", opts.id), move |sock, _| {
            let conn = next_conn.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            serve_conn(sock, conn, tx.clone(), secret.clone())
        }));
    }
    // Keep a control link to the metadata service.
    {
        let tx = tx.clone();
        let secret = secret.clone();
        let boot_id: u64 = rand::random();
        // A disk empty at boot is fresh (it holds nothing it used to) only until a map shows
        // this shard up and in sync: from then on it holds what the others hold, and a
        // registration (with a standby that took over, say) must not claim an empty disk.
        // Claimed on every registration, it made a new leader clear every live shard's in-sync
        // flag, and with one in-sync shard lost (with the old leader's host) none could lead.
        let in_sync_seen = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let leased = opts.lease.is_some();
        // With the control store, the link follows the metadata leader's election.
        let leader = opts.lease.as_ref().map(|l| LeaderWatch::spawn(l.store_url.clone(), l.cluster.clone(), l.cluster_id.clone()));
        let (meta_addr, id) = (opts.meta_addr.clone(), opts.id);
        let advertise = advertise.clone();
        tokio::spawn(async move {
            // The last link ended because another service was elected: that one is dialled
            // at once, and alone at first (see `dial_new_leader`).
            let mut new_leader = false;
            loop {
                let fresh = boot_is_empty && !in_sync_seen.load(Ordering::Relaxed);
                let ended = meta_link(&meta_addr, id, &advertise, boot_id, fresh, leased, leader.as_ref(), new_leader, &tx, &secret, &in_sync_seen).await;
                new_leader = matches!(&ended, Err(e) if e.is::<LeaderChanged>());
                if let Err(e) = ended {
                    tracing::warn!("metadata link to {meta_addr}: {e:#}; reconnecting");
                }
                if !new_leader {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        });
    }
    if let Some(lease) = opts.lease.clone() {
        tokio::spawn(lease_loop(lease, opts.id, advertise.clone(), tx.clone(), start));
    }
    // Clock.
    {
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut iv = tokio::time::interval(Duration::from_millis(TICK_INTERVAL_MS));
            loop {
                iv.tick().await;
                if tx.send(CoreEvent::Input(Input::Tick)).await.is_err() {
                    return;
                }
            }
        });
    }
    core_loop(core, rx, tx, store, secret, opts.id, stats, opts.injected, start).await;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn core_loop(
    mut core: ShardCore,
    mut rx: mpsc::Receiver<CoreEvent>,
    tx: mpsc::Sender<CoreEvent>,
    store: Arc<FileStore>,
    secret: Arc<[u8]>,
    me: ShardId,
    stats: Arc<Stats>,
    injected: InjectedLatency,
    // The core's clock (monotonic, µs since this instant), read as each input is handled.
    start: Instant,
) {
    let mut clients: HashMap<u64, mpsc::Sender<Msg>> = HashMap::new();
    let mut peers: HashMap<ShardId, mpsc::Sender<Msg>> = HashMap::new();
    let mut meta: Option<mpsc::Sender<Msg>> = None;
    // Whether the core's fence was up after the last input (its changes are logged).
    let mut fenced = core.fence().is_some();
    let disk_slots = Arc::new(tokio::sync::Semaphore::new(MAX_DISK_COMMANDS_IN_FLIGHT));
    // Results of disk commands run on this thread ([`runs_inline`]), handled before new events.
    let mut done_here: Option<CoreEvent> = None;
    loop {
        let ev = match done_here.take() {
            Some(ev) => ev,
            None => match rx.recv().await {
                Some(ev) => ev,
                None => return,
            },
        };
        let outputs = match ev {
            CoreEvent::Input(input) => {
                match &input {
                    Input::Msg { .. } => {
                        stats.messages_in.fetch_add(1, Ordering::Relaxed);
                    }
                    Input::Disk { result, .. } => {
                        stats.disk_ops.fetch_add(1, Ordering::Relaxed);
                        if result.is_err() {
                            stats.disk_errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Input::Tick => {
                        *stats.core.lock().unwrap() = core.stats();
                    }
                    Input::Lease(_) => {}
                }
                core.handle(start.elapsed().as_micros() as u64, input);
                if core.fence().is_some() != fenced {
                    fenced = !fenced;
                    match core.fence() {
                        Some(f) => eprintln!("shard {me}: fenced: refusing client I/O ({})", f.why),
                        None => eprintln!("shard {me}: fence lifted: serving again"),
                    }
                }
                core.take_outputs()
            }
            CoreEvent::ClientConn(c, s) => {
                clients.insert(c, s);
                continue;
            }
            CoreEvent::ClientGone(c) => {
                clients.remove(&c);
                continue;
            }
            CoreEvent::PeerGone(s) => {
                peers.remove(&s);
                continue;
            }
            CoreEvent::MetaConn(s) => {
                meta = Some(s);
                continue;
            }
        };
        let mut inline: Option<DiskJob> = None;
        for out in outputs {
            match out {
                Output::Send { to: Peer::Client(c), msg } => {
                    if let Some(s) = clients.get(&c) {
                        if s.try_send(msg).is_err() {
                            stats.messages_dropped.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                Output::Send { to: Peer::Meta, msg } => {
                    if let Msg::Recovered { epoch, .. } = &msg {
                        tracing::debug!(epoch, linked = meta.is_some(), "reporting recovery to the metadata service");
                    }
                    if let Some(s) = &meta {
                        let _ = s.try_send(msg);
                    }
                }
                Output::Send { to: Peer::Shard(s), msg } => {
                    if !peers.contains_key(&s) {
                        let Some(addr) = core.map().and_then(|m| m.addr(s)).map(str::to_string) else { continue };
                        let (ptx, prx) = mpsc::channel(CONN_QUEUE_MSGS);
                        peers.insert(s, ptx);
                        tokio::spawn(peer_link(me, s, addr, prx, tx.clone(), secret.clone()));
                    }
                    if peers[&s].try_send(msg).is_err() {
                        stats.messages_dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Output::Disk { id, cmd } => {
                    let job = DiskJob { id, cmd, queued: Instant::now(), store: store.clone(), tx: tx.clone(), stats: stats.clone(), injected, me };
                    if inline.is_none() && runs_inline(&job, &disk_slots, &rx) {
                        inline = Some(job);
                        continue;
                    }
                    match disk_slots.clone().try_acquire_owned() {
                        // The common case: straight onto a blocking thread, which hands the
                        // result back to this loop itself (two async task hops fewer on every
                        // write's path than waiting for the slot and the thread in a task).
                        Ok(permit) => {
                            tokio::task::spawn_blocking(move || {
                                let (id, result, tx) = job.run();
                                drop(permit);
                                // Rarely full: `try_send` spares the common case `blocking_send`'s
                                // park-and-enter machinery.
                                if let Err(mpsc::error::TrySendError::Full(ev)) = tx.try_send(CoreEvent::Input(Input::Disk { id, result })) {
                                    let _ = tx.blocking_send(ev);
                                }
                            });
                        }
                        Err(_) => {
                            let slots = disk_slots.clone();
                            tokio::spawn(async move {
                                let Ok(permit) = slots.acquire_owned().await else { return };
                                let done = tokio::task::spawn_blocking(move || {
                                    let r = job.run();
                                    drop(permit);
                                    r
                                })
                                .await;
                                if let Ok((id, result, tx)) = done {
                                    let _ = tx.send(CoreEvent::Input(Input::Disk { id, result })).await;
                                }
                            });
                        }
                    }
                }
            }
        }
        if let Some(job) = inline {
            // Let the writer tasks send what this batch queued (a primary's replication
            // messages) before this thread blocks on the disk.
            tokio::task::yield_now().await;
            let (id, result, _) = job.run();
            done_here = Some(CoreEvent::Input(Input::Disk { id, result }));
        }
    }
}

/// Whether a disk command runs on the core's own thread rather than a blocking thread: only
/// when the shard is otherwise idle (no disk command running, no event waiting), as at I/O
/// depth 1, where the two thread hand-offs (to a blocking thread and back) are a large part of
/// a write's latency. A busy shard keeps its disk commands in parallel on blocking threads.
/// Only small, bounded commands qualify (a read, an object write of at most 64 KiB), and
/// never with injected latency (it would sleep this thread) or a journal (an append may wait for
/// a checkpoint run elsewhere).
fn runs_inline(job: &DiskJob, disk_slots: &tokio::sync::Semaphore, rx: &mpsc::Receiver<CoreEvent>) -> bool {
    let small = match &job.cmd {
        DiskCmd::Read { len, .. } => *len as usize <= INLINE_MAX_BYTES,
        // A child's first write counts too (it copies only the parent sectors it touches), so
        // super and plain volumes get the same path at depth 1.
        DiskCmd::Apply { op, .. } => match op {
            RepOp::Put { data } | RepOp::Write { data, .. } => data.len() <= INLINE_MAX_BYTES,
            RepOp::Zero { .. } => false,
        },
        _ => false,
    };
    small
        && job.injected == InjectedLatency::default()
        && !job.store.has_journal()
        && disk_slots.available_permits() == MAX_DISK_COMMANDS_IN_FLIGHT && rx.is_empty()
}

/// Largest payload of a disk command [`runs_inline`] lets run on the core's thread.
const INLINE_MAX_BYTES: usize = 64 * 1024;

/// A disk command on its way to a blocking thread.
struct DiskJob {
    id: u64,
    cmd: DiskCmd,
    queued: Instant,
    store: Arc<FileStore>,
    tx: mpsc::Sender<CoreEvent>,
    stats: Arc<Stats>,
    injected: InjectedLatency,
    me: ShardId,
}

impl DiskJob {
    /// Runs the command (blocking) and keeps the counters; returns what the core gets back.
    fn run(self) -> (u64, Result<crate::core::shard::DiskOut, crate::core::shard::DiskErr>, mpsc::Sender<CoreEvent>) {
        let DiskJob { id, cmd, queued, store, tx, stats, injected, me } = self;
        let delay = injected.for_cmd(&cmd);
        let what = disk_cmd_kind(&cmd);
        let kind = DISK_KINDS.iter().position(|k| *k == what).unwrap_or(0);
        let started = Instant::now();
        stats.disk_wait_us.fetch_add((started - queued).as_micros() as u64, Ordering::Relaxed);
        // A panic in the store fails this command (as a failed disk task did), not the shard.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.run(cmd)))
            .unwrap_or_else(|_| Err(crate::core::shard::DiskErr::Io("disk command panicked".into())));
        let ran = started.elapsed();
        stats.disk_kind_ops[kind].fetch_add(1, Ordering::Relaxed);
        stats.disk_kind_run_us[kind].fetch_add(ran.as_micros() as u64, Ordering::Relaxed);
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        let total = queued.elapsed();
        if total >= Duration::from_millis(SLOW_DISK_COMMAND_MS) {
            let n = stats.slow_disk_ops.fetch_add(1, Ordering::Relaxed) + 1;
            // A stall of the disk itself (not a queue of our own commands) is logged, at most
            // once a second.
            let now_ms = stats.started.elapsed().as_millis() as u64;
            let last = stats.slow_logged_ms.load(Ordering::Relaxed);
            if ran >= Duration::from_millis(SLOW_DISK_COMMAND_MS)
                && (last == 0 || now_ms >= last + 1000)
                && stats.slow_logged_ms.compare_exchange(last, now_ms.max(1), Ordering::Relaxed, Ordering::Relaxed).is_ok()
            {
                tracing::info!(
                    shard = me,
                    command = what,
                    total_ms = total.as_millis() as u64,
                    ran_ms = ran.as_millis() as u64,
                    slow_so_far = n,
                    "slow disk command"
                );
            }
        }
        (id, result, tx)
    }
}

/// The kinds [`disk_cmd_kind`] names, as the metrics label them.
pub const DISK_KINDS: [&str; 8] = ["read", "read-all", "apply-cow", "apply", "delete", "rename", "save-state", "prestock"];

fn disk_cmd_kind(cmd: &DiskCmd) -> &'static str {
    match cmd {
        DiskCmd::Read { .. } => "read",
        DiskCmd::ReadAll { .. } => "read-all",
        DiskCmd::Apply { cow_from: Some(_), .. } => "apply-cow",
        DiskCmd::Apply { .. } => "apply",
        DiskCmd::Delete { .. } => "delete",
        DiskCmd::Rename { .. } => "rename",
        DiskCmd::SaveState { .. } => "save-state",
        DiskCmd::Prestock { .. } => "prestock",
    }
}

/// Authenticates and identifies an outgoing connection, over TLS when this process's link
/// setting asks for it for `addr` ([`wire::link::process`]).
/// Dials the metadata service given as one address or several, comma-separated (a service with
/// standbys, `volume meta --store`): tries them in order and keeps the first that answers. Only
/// the leader listens, so the first connection made is to the leader (or to a deposed leader
/// about to exit, whose link then ends and is dialled again).
/// How long one metadata address may take to connect and authenticate before the next is tried.
pub const META_DIAL_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a newly elected metadata leader is dialled alone, and how often, before the whole
/// address list: it binds its address just after its election shows, so the first dials may
/// be refused, and the list behind it may hold a dead host's address, which costs a whole
/// [`META_DIAL_TIMEOUT`] (issue 24: the host-loss stall of `bench control failover`).
pub const NEW_LEADER_BIND_WAIT: Duration = Duration::from_secs(2);
pub const NEW_LEADER_REDIAL_INTERVAL: Duration = Duration::from_millis(50);

/// The metadata link ended because another service was elected (it names that one's address).
#[derive(Debug, thiserror::Error)]
#[error("the metadata leader changed to {0}")]
pub struct LeaderChanged(pub String);

/// Dials `addr`, a metadata leader just elected, alone until it answers or
/// [`NEW_LEADER_BIND_WAIT`] passes; None then (the caller dials the whole list).
pub async fn dial_new_leader(addr: &str, secret: &[u8], hello: &Hello) -> Option<wire::link::Link> {
    let until = std::time::Instant::now() + NEW_LEADER_BIND_WAIT;
    while std::time::Instant::now() < until {
        if let Ok(Ok(link)) = tokio::time::timeout(META_DIAL_TIMEOUT, dial(addr, secret, hello)).await {
            return Some(link);
        }
        tokio::time::sleep(NEW_LEADER_REDIAL_INTERVAL).await;
    }
    None
}

pub async fn dial_meta(addrs: &str, secret: &[u8], hello: &Hello) -> anyhow::Result<wire::link::Link> {
    Ok(dial_meta_at(addrs, secret, hello).await?.0)
}

/// [`dial_meta`], also telling which address answered.
pub async fn dial_meta_at(addrs: &str, secret: &[u8], hello: &Hello) -> anyhow::Result<(wire::link::Link, String)> {
    let mut errors = Vec::new();
    for a in addrs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        // A paused old leader's kernel still accepts connections; its handshake never comes.
        match tokio::time::timeout(META_DIAL_TIMEOUT, dial(a, secret, hello)).await {
            Ok(Ok(s)) => return Ok((s, a.to_string())),
            Ok(Err(e)) => errors.push(format!("{a}: {e:#}")),
            Err(_) => errors.push(format!("{a}: no handshake within {META_DIAL_TIMEOUT:?}")),
        }
    }
    anyhow::bail!("no metadata service answered ({})", if errors.is_empty() { "no address given".to_string() } else { errors.join("; ") })
}

pub async fn dial(addr: &str, secret: &[u8], hello: &Hello) -> anyhow::Result<wire::link::Link> {
    let sock = tokio::time::timeout(Duration::from_secs(3), TcpStream::connect(addr))
        .await
        .with_context(|| format!("timed out connecting to {addr}"))?
        .with_context(|| format!("cannot connect to {addr}"))?;
    sock.set_nodelay(true)?;
    let mut sock = wire::link::connect(sock, wire::link::process()?).await?;
    wire::auth::connect(&mut sock, secret).await.with_context(|| format!("authenticating to {addr}"))?;
    wire::write_msg(&mut sock, hello).await?;
    // Over TLS a write may leave its last record in the session until a flush.
    tokio::io::AsyncWriteExt::flush(&mut sock).await?;
    Ok(sock)
}

/// Writes queued messages to a socket, flushing whenever the queue runs dry.
pub async fn writer_loop<W: tokio::io::AsyncWrite + Unpin>(w: W, mut rx: mpsc::Receiver<Msg>) {
    let mut w = BufWriter::with_capacity(256 * 1024, w);
    while let Some(msg) = rx.recv().await {
        if wire::write_msg(&mut w, &msg).await.is_err() {
            return;
        }
        while let Ok(msg) = rx.try_recv() {
            if wire::write_msg(&mut w, &msg).await.is_err() {
                return;
            }
        }
        if tokio::io::AsyncWriteExt::flush(&mut w).await.is_err() {
            return;
        }
    }
}

async fn peer_link(
    me: ShardId,
    peer: ShardId,
    addr: String,
    rx: mpsc::Receiver<Msg>,
    tx: mpsc::Sender<CoreEvent>,
    secret: Arc<[u8]>,
) {
    match dial(&addr, &secret, &Hello::Shard(me)).await {
        Ok(sock) => {
            let (r, w) = sock.into_split();
            // The link ends when either half does: a peer that died closes our read half at
            // once, while writes to it may still succeed until its reset comes back, and what
            // they carry is lost. Ending here lets the next message dial afresh (the peer may
            // be back already) instead of going into a dead socket; what was in flight is
            // resent by the core's timer.
            let mut reader = tokio::spawn(read_loop(r, Peer::Shard(peer), tx.clone()));
            tokio::select! {
                _ = writer_loop(w, rx) => reader.abort(),
                _ = &mut reader => {}
            }
        }
        Err(e) => tracing::debug!("link to shard {peer} at {addr}: {e:#}"),
    }
    let _ = tx.send(CoreEvent::PeerGone(peer)).await;
}

async fn read_loop<R: tokio::io::AsyncRead + Unpin>(r: R, from: Peer, tx: mpsc::Sender<CoreEvent>) {
    let mut r = tokio::io::BufReader::with_capacity(256 * 1024, r);
    loop {
        match wire::read_msg::<Msg, _>(&mut r, wire::MAX_FRAME_PAYLOAD_BYTES).await {
            Ok(msg) => {
                if tx.send(CoreEvent::Input(Input::Msg { from, msg })).await.is_err() {
                    return;
                }
            }
            Err(wire::WireError::Closed) => return,
            Err(e) => {
                tracing::warn!("closing connection from {from:?}: {e}");
                return;
            }
        }
    }
}

async fn serve_conn(sock: TcpStream, conn: u64, tx: mpsc::Sender<CoreEvent>, secret: Arc<[u8]>) {
    let hello = async {
        let mut sock = wire::link::accept_authenticated(sock, &secret).await?;
        let hello = wire::read_msg::<Hello, _>(&mut sock, 1024).await?;
        Ok::<_, wire::WireError>((sock, hello))
    };
    let (sock, hello) = match tokio::time::timeout(Duration::from_secs(5), hello).await {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => return tracing::warn!("refused connection: {e}"),
        Err(_) => return tracing::warn!("refused connection: handshake timed out"),
    };
    let (r, w) = sock.into_split();
    match hello {
        Hello::Shard(s) => read_loop(r, Peer::Shard(s), tx).await,
        Hello::Client => {
            let (ctx, crx) = mpsc::channel(CONN_QUEUE_MSGS);
            if tx.send(CoreEvent::ClientConn(conn, ctx)).await.is_err() {
                return;
            }
            let writer = tokio::spawn(writer_loop(w, crx));
            read_loop(r, Peer::Client(conn), tx.clone()).await;
            writer.abort();
            let _ = tx.send(CoreEvent::ClientGone(conn)).await;
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn meta_link(
    meta_addr: &str,
    id: ShardId,
    advertise: &str,
    boot_id: u64,
    fresh: bool,
    leased: bool,
    leader: Option<&LeaderWatch>,
    new_leader: bool,
    tx: &mpsc::Sender<CoreEvent>,
    secret: &[u8],
    in_sync_seen: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<()> {
    // The leader as seen when dialling: the link is taken to be to it.
    let mut at = leader.and_then(|w| w.current());
    let alone = match &at {
        Some(l) if new_leader && meta_addr.split(',').any(|a| a.trim() == l.addr) => dial_new_leader(&l.addr, secret, &Hello::Shard(id)).await,
        _ => None,
    };
    let sock = match alone {
        Some(s) => s,
        None => dial_meta(&order_addrs(meta_addr, at.as_ref()), secret, &Hello::Shard(id)).await?,
    };
    let (r, w) = sock.into_split();
    let (mtx, mrx) = mpsc::channel(CONN_QUEUE_MSGS);
    mtx.send(Msg::Register { shard: id, addr: advertise.to_string(), boot_id, fresh, leased }).await?;
    tx.send(CoreEvent::MetaConn(mtx)).await?;
    let writer = tokio::spawn(writer_loop(w, mrx));
    let moved = async {
        let Some(w) = leader else { return std::future::pending().await };
        let mut rx = w.subscribe();
        loop {
            let l = changed_from(&mut rx, at.as_ref().map(|l| l.key.as_str())).await;
            if at.is_none() {
                // The first leader seen after dialling (the store was slower than the dial):
                // the one this link reached.
                at = Some(l);
                continue;
            }
            return l;
        }
    };
    let result = tokio::select! {
        ended = meta_read_loop(r, tx.clone(), id, in_sync_seen) => ended,
        l = moved => {
            // A paused or cut-off old leader keeps its connection open: leave it.
            eprintln!("shard {id}: the metadata leader is now {}: leaving the old one's link", l.addr);
            Err(LeaderChanged(l.addr).into())
        }
    };
    writer.abort();
    result
}

/// Keeps the shard's liveness lease: registers `live/shard/<id>` in the control store, reports
/// the lease to the core whenever it changes (the core decides when to fence), and registers
/// again under a new lease once one is lost. It decides nothing itself: a store it cannot reach
/// is reported as no lease.
async fn lease_loop(l: ShardLease, id: ShardId, advertise: String, tx: mpsc::Sender<CoreEvent>, start: Instant) {
    let us = |t: tokio::time::Instant| t.into_std().saturating_duration_since(start).as_micros() as u64;
    let report = |r: LeaseReport| {
        let tx = tx.clone();
        async move { tx.send(CoreEvent::Input(Input::Lease(r))).await.is_ok() }
    };
    let store = loop {
        match control::Store::open(&l.store_url, &l.cluster, &l.cluster_id).await {
            Ok(s) => break s,
            Err(e) => {
                tracing::warn!("shard {id}: cannot open the control store {}: {e}; trying again", l.store_url);
                if !report(LeaseReport::Lost { why: format!("cannot open the control store: {e}") }).await {
                    return;
                }
                tokio::time::sleep(LEASE_RETRY_INTERVAL).await;
            }
        }
    };
    let ttl_us = l.ttl.as_micros() as u64;
    loop {
        let reg = match store.register("shard", &id.to_string(), &advertise, l.ttl).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("shard {id}: cannot register in the control store: {e}; trying again");
                if !report(LeaseReport::Lost { why: format!("cannot register in the control store: {e}") }).await {
                    return;
                }
                tokio::time::sleep(LEASE_RETRY_INTERVAL).await;
                continue;
            }
        };
        eprintln!("shard {id}: registered in the control store under lease {:x} (TTL {} ms)", reg.lease(), l.ttl.as_millis());
        let mut last = None;
        loop {
            if let Some(why) = reg.lost_reason() {
                eprintln!("shard {id}: lost its lease in the control store ({why}); registering again");
                if !report(LeaseReport::Lost { why }).await {
                    return;
                }
                break;
            }
            let now = LeaseReport::Held { lease: reg.lease(), ttl_us, sure_until_us: us(reg.valid_until()) };
            if last.as_ref() != Some(&now) {
                last = Some(now.clone());
                if !report(now).await {
                    return;
                }
            }
            tokio::time::sleep(LEASE_REPORT_INTERVAL).await;
        }
    }
}

/// A metadata link that carries nothing for this long is given up and the service list dialled
/// again. The service pings every shard every `--ping-interval-ms` (250 ms by default, at most
/// [`MAX_META_PING_INTERVAL`]), so silence means its process is stopped, or its host died or was
/// cut off: then no FIN or RST ever comes, and without this the shard would wait on the dead
/// leader for good (TCP gives up on a silent peer only after many minutes), never registering
/// with the standby that took over.
pub const META_SILENCE_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest ping interval a metadata service may run with: well under
/// [`META_SILENCE_TIMEOUT`], so a live service is never taken for a silent one.
pub const MAX_META_PING_INTERVAL: Duration = Duration::from_secs(1);

/// [`read_loop`] for the metadata link: also ends when the service is silent for
/// [`META_SILENCE_TIMEOUT`]. Always returns why the link ended.
async fn meta_read_loop<R: tokio::io::AsyncRead + Unpin>(
    r: R,
    tx: mpsc::Sender<CoreEvent>,
    me: ShardId,
    in_sync_seen: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<()> {
    let mut r = tokio::io::BufReader::with_capacity(256 * 1024, r);
    loop {
        // Cancelling a read mid-frame is harmless: the link is dropped with it.
        match tokio::time::timeout(META_SILENCE_TIMEOUT, wire::read_msg::<Msg, _>(&mut r, wire::MAX_FRAME_PAYLOAD_BYTES)).await {
            Err(_) => bail!("metadata service silent for {META_SILENCE_TIMEOUT:?} (stopped, or its host lost or cut off)"),
            Ok(Ok(msg)) => {
                if let Msg::Map(m) = &msg {
                    tracing::debug!(epoch = m.epoch, "cluster map from the metadata service");
                    if m.shards.iter().any(|s| s.id == me && s.state == ShardState::Up && s.in_sync) {
                        in_sync_seen.store(true, Ordering::Relaxed);
                    }
                }
                if tx.send(CoreEvent::Input(Input::Msg { from: Peer::Meta, msg })).await.is_err() {
                    bail!("shard stopping");
                }
            }
            Ok(Err(wire::WireError::Closed)) => bail!("metadata service closed the link"),
            Ok(Err(e)) => bail!("metadata link: {e}"),
        }
    }
}
