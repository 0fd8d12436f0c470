//! Tokio drivers: the node server ([`run_node`]), the CM server ([`run_cm`]) and the async
//! client ([`KvClient`], [`KvCluster`]). They run the sans-I/O cores unchanged.
//!
//! Every TCP connection starts with `wire::auth` (mutual HMAC over the cluster secret), then a
//! [`NetMsg::Hello`] saying who connects; then frames of [`NetMsg`] (`wire` framing, size-limited).
//! Nodes dial each other (one outbound connection per peer, reconnecting); the CM dials every
//! node; clients dial any node and may keep many requests in flight on one connection.
//!
//! Persistence runs on a dedicated thread owning the [`FileLog`]: appends are taken in order and
//! batched (group commit), each batch one `O_DSYNC` write, or, when it is large or a sync is in
//! flight, written and synced by a second thread while the next batch is written (see
//! `Syncer`); each durable append is reported in order.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

use super::events::{Event, EventLog, SinceStart};
use crate::leaderless::core::cm::{CmCore, CmInput, CmOutput, CmParams};
use crate::leaderless::core::node::{NodeCore, NodeInput, NodeParams, Output, RecoveryStats};
use crate::leaderless::proto::*;
use crate::pmlog::{self, Append, FileLog, LogRecord};

/// Largest frame a node or client accepts (a CatchUp_resp chunk or a maximal value, plus room).
pub const MAX_FRAME_BYTES: usize = 4 * 1024 * 1024;
/// Messages queued per peer connection before new ones are dropped (the protocol retransmits).
pub const PEER_QUEUE_MSGS: usize = 65_536;
/// Requests a client connection may have in flight.
pub const CLIENT_INFLIGHT_MAX: usize = 4096;
/// Inputs (peer messages, client requests, log completions) queued for a node's core. Past it
/// the connections' readers wait, so TCP pushes back on the senders rather than the queue
/// adding latency without bound.
pub const INPUT_QUEUE_MSGS: usize = 8192;
/// Read buffer of a node's inbound connection.
pub const CONN_READ_BUFFER_BYTES: usize = 64 << 10;
/// Queued frames to one connection are coalesced into writes of about this many bytes at most.
pub const CONN_WRITE_BATCH_BYTES: usize = 1 << 20;
/// Kernel send (outbound) and receive (inbound) buffer of a connection between nodes: room for
/// a few whole catch-up chunks, so a chunk goes out in one write rather than in many hand-offs
/// between two busy processes (capped by `net.core.wmem_max` / `rmem_max`).
pub const PEER_SOCKET_BUFFER_BYTES: usize = 4 << 20;
/// Period of a node's timer checks.
pub const NODE_TICK_MS: u64 = 5;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Hello {
    Peer(NodeId),
    Cm,
    Client,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum NetMsg {
    Hello(Hello),
    Peer(PeerMsg),
    Hb(Heartbeat),
    HbAck(HeartbeatAck),
    Req { id: u64, op: ClientOp },
    Resp { id: u64, result: ClientResult },
}

#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error(transparent)]
    Wire(#[from] wire::WireError),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("log error: {0}")]
    Log(#[from] pmlog::LogError),
    #[error("no node answered: {0}")]
    Unavailable(String),
    #[error("request refused: {0}")]
    Refused(String),
    #[error("timed out after {0:?} (the operation may or may not have taken effect)")]
    Timeout(Duration),
}

async fn handshake_client<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &[u8],
    hello: Hello,
) -> Result<(), KvError> {
    wire::auth::connect(s, secret).await?;
    wire::write_msg(s, &NetMsg::Hello(hello)).await?;
    Ok(())
}

// ------------------------------------------------------------------------------ node

/// What a node process needs.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub params: NodeParams,
    pub listen: SocketAddr,
    /// Every node's address, by id (this node's included).
    pub peers: BTreeMap<NodeId, SocketAddr>,
    pub data_dir: PathBuf,
    pub secret: Vec<u8>,
    pub extra_persist_latency: Duration,
    pub metrics: Option<SocketAddr>,
    /// Where to append structured events (one JSON line each; see [`super::events`]).
    pub events: Option<PathBuf>,
}

enum Input {
    /// A peer's message and when its frame had been decoded.
    Peer(NodeId, PeerMsg, Instant),
    Client {
        id: u64,
        op: ClientOp,
        reply: mpsc::Sender<NetMsg>,
    },
    /// Durable appends as (core incarnation, seq): a core rebuilt by `Reload` numbers its
    /// appends from 0 again, so completions of the old one's must not reach it.
    Persisted(Vec<(u64, u64)>),
    LogRead {
        to: NodeId,
        cursor: pmlog::LogCursor,
        chunk: pmlog::LogChunk,
    },
}

enum LogJob {
    /// Appends, in order, each with the (core incarnation, seq) to report once it is durable,
    /// or `None` for a lazy append (a GDP flag, an `Epoch` record). The core's outputs of one
    /// input go as one job; a catch-up chunk is one append, encoded here, off the core's thread.
    Append(Vec<(Option<(u64, u64)>, Append)>),
    /// Rebuild the state from the log; with `Some(node)`, replace the log with a new node's
    /// first (the full-copy baseline: [`FileLog::reset_as_new_node`]).
    Rebuild(std::sync::mpsc::Sender<pmlog::LogState>, Option<NodeId>),
    /// Reactive-log baseline: read the log at a cursor, after every append queued before.
    Read {
        to: NodeId,
        cursor: pmlog::LogCursor,
        max_bytes: usize,
    },
}

/// The log thread writes at most about this many bytes of queued appends per write (and sync):
/// large enough that a catch-up's many chunks cost few syncs, bounded so one write's latency
/// stays in the tens of milliseconds.
pub const MAX_LOG_BATCH_BYTES: usize = 32 << 20;

/// Numbers a node exposes on its metrics endpoint.
#[derive(Default)]
pub struct NodeStats {
    pub epoch: AtomicU64,
    pub serving: AtomicU64,
    pub keys: AtomicU64,
    pub stored_bytes: AtomicU64,
    pub missed_updates_bytes: AtomicU64,
    pub log_bytes: AtomicU64,
    pub log_compactions: AtomicU64,
    pub recoveries: AtomicU64,
    /// Durable appends: syncs (an `O_DSYNC` write or an `fdatasync` of the syncer), bytes, and
    /// time spent writing and syncing them (the log thread's and the syncer's, summed).
    pub log_durable_writes: AtomicU64,
    pub log_durable_bytes: AtomicU64,
    pub log_durable_us: AtomicU64,
    /// Part of `log_durable_us`: encoding the records into the write buffer.
    pub log_encode_us: AtomicU64,
    pub last_recovery: Mutex<Option<RecoveryStats>>,
    /// Catch-up phases, microseconds summed since start (where a catch-up's time goes). On the
    /// recovering node: checksumming and decoding CatchUp_resp frames, their wait in the input
    /// queue, the core applying them (with handing the chunk's append to the log thread), and
    /// the node loop waiting for any input while recovering.
    pub catchup_decode_us: AtomicU64,
    pub catchup_queue_us: AtomicU64,
    pub catchup_apply_us: AtomicU64,
    /// Handling log completions while recovering (each applied entry's durable version).
    pub catchup_persisted_us: AtomicU64,
    pub recovering_idle_us: AtomicU64,
    /// On a Buddy: building chunks (the core's store walk and value copies), encoding their
    /// frames, and writing them to the socket, and the chunks sent.
    pub catchup_build_us: AtomicU64,
    pub catchup_encode_us: AtomicU64,
    pub catchup_write_us: AtomicU64,
    pub catchup_chunks_sent: AtomicU64,
}

fn add_us(c: &AtomicU64, since: Instant) {
    c.fetch_add(since.elapsed().as_micros() as u64, Ordering::Relaxed);
}

/// Sync jobs queued for the log's syncer thread at most (the log thread waits past it).
pub const LOG_SYNC_QUEUE_JOBS: usize = 1024;

/// The second half of a pipelined group commit: appends the log thread has written (and
/// started the write-back of) are made durable here, with one `fdatasync` for every job
/// queued by then, and reported in order, while the log thread encodes and writes the next
/// ones. Without it the log thread would wait for each sync (several milliseconds of device
/// flush) before writing what arrived meanwhile, which paced a catch-up's durable log.
struct Syncer {
    tx: std::sync::mpsc::SyncSender<(std::fs::File, Vec<(u64, u64)>)>,
    /// Jobs sent and not yet reported.
    pending: Arc<(Mutex<usize>, std::sync::Condvar)>,
}

impl Syncer {
    fn spawn(inputs: mpsc::UnboundedSender<Input>, stats: Arc<NodeStats>, extra: Duration) -> Self {
        let (tx, rx) =
            std::sync::mpsc::sync_channel::<(std::fs::File, Vec<(u64, u64)>)>(LOG_SYNC_QUEUE_JOBS);
        let pending = Arc::new((Mutex::new(0usize), std::sync::Condvar::new()));
        let p = pending.clone();
        std::thread::Builder::new()
            .name("kv-log-sync".into())
            .spawn(move || {
                // Ends when the log thread drops the sender.
                while let Ok((mut file, mut seqs)) = rx.recv() {
                    let mut jobs = 1;
                    // Every queued job was written before it was queued: one sync covers all.
                    while let Ok((f, s)) = rx.try_recv() {
                        file = f;
                        seqs.extend(s);
                        jobs += 1;
                    }
                    let t = Instant::now();
                    if let Err(e) = file.sync_data() {
                        // A node that cannot persist must not acknowledge anything: stop it.
                        tracing::error!("log sync failed: {e}; stopping");
                        eprintln!("error: persistent log sync failed: {e}");
                        std::process::exit(2);
                    }
                    if !extra.is_zero() {
                        std::thread::sleep(extra);
                    }
                    stats.log_durable_writes.fetch_add(1, Ordering::Relaxed);
                    add_us(&stats.log_durable_us, t);
                    let _ = inputs.send(Input::Persisted(seqs));
                    let (n, cv) = &*p;
                    *n.lock().unwrap() -= jobs;
                    cv.notify_all();
                }
            })
            .expect("spawning the log sync thread");
        Syncer { tx, pending }
    }

    fn idle(&self) -> bool {
        *self.pending.0.lock().unwrap() == 0
    }

    fn send(&self, file: std::fs::File, seqs: Vec<(u64, u64)>) {
        *self.pending.0.lock().unwrap() += 1;
        if self.tx.send((file, seqs)).is_err() {
            *self.pending.0.lock().unwrap() -= 1;
        }
    }

    /// Waits until every job sent is durable and reported.
    fn drain(&self) {
        let (n, cv) = &*self.pending;
        let mut n = n.lock().unwrap();
        while *n > 0 {
            n = cv.wait(n).unwrap();
        }
    }
}

fn spawn_log_thread(
    mut flog: FileLog,
    inputs: mpsc::UnboundedSender<Input>,
    stats: Arc<NodeStats>,
) -> std::sync::mpsc::Sender<LogJob> {
    let (tx, rx) = std::sync::mpsc::channel::<LogJob>();
    let syncer = Syncer::spawn(inputs.clone(), stats.clone(), flog.extra_persist_latency());
    std::thread::Builder::new()
        .name("kv-log".into())
        .spawn(move || {
            while let Ok(first) = rx.recv() {
                let mut batch = vec![first];
                let mut bytes = 0usize;
                let job_bytes = |j: &LogJob| match j {
                    LogJob::Append(v) => v.iter().map(|(_, r)| r.size_hint()).sum(),
                    _ => 0,
                };
                bytes += job_bytes(&batch[0]);
                while bytes < MAX_LOG_BATCH_BYTES {
                    let Ok(j) = rx.try_recv() else { break };
                    bytes += job_bytes(&j);
                    batch.push(j);
                }
                let mut recs = Vec::new();
                let mut seqs = Vec::new();
                let mut reads = Vec::new();
                let mut log_reads = Vec::new();
                for j in batch {
                    match j {
                        LogJob::Append(v) => {
                            for (done, r) in v {
                                if let Some(d) = done {
                                    seqs.push(d);
                                }
                                recs.push(r);
                            }
                        }
                        LogJob::Rebuild(reply, as_new) => reads.push((reply, as_new)),
                        LogJob::Read {
                            to,
                            cursor,
                            max_bytes,
                        } => log_reads.push((to, cursor, max_bytes)),
                    }
                }
                // A small batch with nothing being synced is one `O_DSYNC` write, here (the
                // shortest wait); any other durable batch is written and handed to the syncer
                // (behind what it is syncing: completions stay in log order).
                let alone = syncer.idle() && bytes <= pmlog::DSYNC_WRITE_MAX_BYTES;
                let res = if recs.is_empty() {
                    Ok(())
                } else if seqs.is_empty() {
                    flog.append_items_lazy(&recs)
                } else {
                    let (t, len0, enc0) = (Instant::now(), flog.len_bytes(), flog.encode_us);
                    let r = if alone {
                        flog.append_items_durable(&recs)
                    } else {
                        flog.append_items_written(&recs)
                    };
                    stats
                        .log_encode_us
                        .fetch_add(flog.encode_us - enc0, Ordering::Relaxed);
                    stats
                        .log_durable_bytes
                        .fetch_add(flog.len_bytes() - len0, Ordering::Relaxed);
                    if alone {
                        stats.log_durable_writes.fetch_add(1, Ordering::Relaxed);
                    }
                    add_us(&stats.log_durable_us, t);
                    r
                };
                if let Err(e) = res {
                    // A node that cannot persist must not acknowledge anything: stop it.
                    tracing::error!("log append failed: {e}; stopping");
                    eprintln!("error: persistent log append failed: {e}");
                    std::process::exit(2);
                }
                if !seqs.is_empty() {
                    if alone {
                        if inputs.send(Input::Persisted(seqs)).is_err() {
                            return;
                        }
                    } else {
                        match flog.sync_handle() {
                            Ok(f) => syncer.send(f, seqs),
                            Err(e) => {
                                tracing::error!("log sync handle: {e}; stopping");
                                eprintln!("error: persistent log sync handle: {e}");
                                std::process::exit(2);
                            }
                        }
                    }
                }
                // A rebuild and a compaction see a log whose appends are all durable (and a
                // compaction replaces the file the syncer's handles refer to). A log read of
                // the reactive baseline does not wait for the sync: it reads every append
                // written before it (from the page cache), and what it sends is judged
                // against the store, not against this log's durability.
                if !reads.is_empty() || flog.wants_compaction() {
                    syncer.drain();
                }
                for (r, as_new) in reads {
                    let st = match as_new {
                        Some(node) => flog.reset_as_new_node(node),
                        None => flog.rebuild_state(),
                    };
                    match st {
                        Ok(st) => {
                            let _ = r.send(st);
                        }
                        Err(e) => {
                            // A default state would make the node a fresh member: stop it.
                            tracing::error!("rebuilding the log: {e}; stopping");
                            eprintln!("error: rebuilding the persistent log failed: {e}");
                            std::process::exit(2);
                        }
                    }
                }
                // Reads see every append queued before them (they were written just above).
                for (to, cursor, max_bytes) in log_reads {
                    match flog.read_chunk(&cursor, max_bytes) {
                        Ok(chunk) => {
                            if inputs.send(Input::LogRead { to, cursor, chunk }).is_err() {
                                return;
                            }
                        }
                        Err(e) => tracing::warn!("reading the log for node {to}: {e}"),
                    }
                }
                match flog.maybe_compact() {
                    Ok(true) => tracing::info!(bytes = flog.len_bytes(), "log compacted"),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::error!("log compaction failed: {e}; stopping");
                        eprintln!("error: persistent log compaction failed: {e}");
                        std::process::exit(2);
                    }
                }
                stats.log_bytes.store(flog.len_bytes(), Ordering::Relaxed);
                stats
                    .log_compactions
                    .store(flog.compactions, Ordering::Relaxed);
            }
        })
        .expect("spawning the log thread");
    tx
}

/// Runs a node until the process is stopped.
pub async fn run_node(cfg: NodeConfig) -> Result<(), KvError> {
    std::fs::create_dir_all(&cfg.data_dir)?;
    let mut events = EventLog::open(cfg.events.as_deref())?;
    let path = cfg.data_dir.join("pm.log");
    let (flog, st) = if cfg.params.drops_state_on_return()
        && cfg.params.returns_as_new_node(FileLog::was_booted(&path)?)
    {
        tracing::info!(
            node = cfg.params.id,
            "full-copy baseline: the returning node's durable state is dropped (a new node \
             replaces it and receives the whole store)"
        );
        FileLog::open_as_new_node(&path, cfg.extra_persist_latency, cfg.params.id)?
    } else {
        FileLog::open_and_rebuild(&path, cfg.extra_persist_latency)?
    };
    tracing::info!(
        node = cfg.params.id,
        records = st.records,
        keys = st.base.len(),
        partially = st.partially.len(),
        booted = st.booted,
        "node starting on its log"
    );
    let listener = TcpListener::bind(cfg.listen).await?;
    let (in_tx, mut in_rx) = mpsc::channel::<Input>(INPUT_QUEUE_MSGS);
    // Heartbeats have their own queue, served first: a busy node must neither look dead to the
    // CM (a false suspicion removes it, and its recovery adds load: the group can spiral into
    // reconfigurations) nor extend its read lease from a heartbeat that sat in a queue.
    let (hb_tx, mut hb_rx) = mpsc::channel::<(Heartbeat, mpsc::Sender<NetMsg>, Instant)>(64);
    let stats = Arc::new(NodeStats::default());
    stats.log_bytes.store(flog.len_bytes(), Ordering::Relaxed);
    // Log completions have a queue of their own, never full: the log thread must not wait on
    // the core (a `Reload` waits on the log thread). It holds at most one entry per append the
    // core asked for.
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Input>();
    let log_tx = spawn_log_thread(flog, done_tx, stats.clone());

    if let Some(m) = cfg.metrics {
        let l = TcpListener::bind(m).await?;
        let stats = stats.clone();
        tokio::spawn(wire::metrics::serve(l, move || {
            let stats = stats.clone();
            async move { render_node_metrics(&stats) }
        }));
    }

    // Outbound peer connections.
    let me = cfg.params.id;
    let mut peer_tx: HashMap<NodeId, mpsc::Sender<PeerMsg>> = HashMap::new();
    for (&id, &addr) in &cfg.peers {
        if id == me {
            continue;
        }
        let (tx, rx) = mpsc::channel(PEER_QUEUE_MSGS);
        peer_tx.insert(id, tx);
        tokio::spawn(peer_writer(me, addr, cfg.secret.clone(), rx, stats.clone()));
    }

    // Inbound connections.
    {
        let secret = cfg.secret.clone();
        let in_tx = in_tx.clone();
        let stats = stats.clone();
        // Accept errors (out of descriptors) are waited out with backoff: retrying at once
        // spun a core while the limit was exceeded.
        tokio::spawn(wire::listen::serve(
            listener,
            format!("kv node {me}"),
            move |sock, _| {
                serve_conn(
                    sock,
                    secret.clone(),
                    in_tx.clone(),
                    hb_tx.clone(),
                    stats.clone(),
                )
            },
        ));
    }

    let start = Instant::now();
    let now_us = || start.elapsed().as_micros() as u64;
    let mut core = NodeCore::new(with_fresh_lease_refs(&cfg.params), st);
    // The rebuild's scaffolding is garbage now; from here on, freed chunk-sized buffers stay
    // in the process for the next ones (after the rebuild, whose large transient buffers
    // must go back to the OS).
    pmlog::release_free_memory();
    pmlog::keep_transient_buffers();
    // Bumped at every `Reload`; log completions carry it.
    let mut inc: u64 = 0;
    let mut last_now = 0u64;
    let mut replies: HashMap<u64, (mpsc::Sender<NetMsg>, u64)> = HashMap::new();
    let mut next_tag: u64 = 1;
    let mut cm_tx: Option<mpsc::Sender<NetMsg>> = None;
    // Timers are checked at this granularity (timeouts are tens of milliseconds).
    let mut tick = tokio::time::interval(Duration::from_millis(NODE_TICK_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        // A Buddy's catch-up stream sends one chunk per turn of this loop, between inputs, and
        // the loop does not wait for an input while the stream has chunks left.
        let pumping = core.wants_pump();
        let recovering = core.is_recovering();
        let waited = Instant::now();
        tokio::select! {
            biased;
            Some((hb, tx, at)) = hb_rx.recv() => {
                if recovering {
                    add_us(&stats.recovering_idle_us, waited);
                }
                // The lease counts from the heartbeat's arrival (never before an earlier input).
                let at_us = (at.saturating_duration_since(start).as_micros() as u64).max(last_now);
                last_now = at_us;
                cm_tx = Some(tx);
                core.handle(at_us, NodeInput::Heartbeat(hb));
            }
            _ = tick.tick() => {
                if recovering {
                    add_us(&stats.recovering_idle_us, waited);
                }
                last_now = now_us();
                core.handle(last_now, NodeInput::Tick);
            }
            Some(inp) = done_rx.recv() => {
                if recovering {
                    add_us(&stats.recovering_idle_us, waited);
                }
                let now = now_us();
                last_now = now;
                match inp {
                    Input::Persisted(seqs) => {
                        let t = Instant::now();
                        core.handle(now, NodeInput::Persisted(seqs.into_iter().filter(|(i, _)| *i == inc).map(|(_, s)| s).collect()));
                        if recovering {
                            add_us(&stats.catchup_persisted_us, t);
                        }
                    }
                    Input::LogRead { to, cursor, chunk } => core.handle(now, NodeInput::LogRead { to, cursor, chunk }),
                    _ => {}
                }
            }
            Some(inp) = in_rx.recv() => {
                if recovering {
                    add_us(&stats.recovering_idle_us, waited);
                }
                let now = now_us();
                last_now = now;
                match inp {
                    Input::Peer(from, m, decoded) => {
                        // Timed phases of a catch-up (see `NodeStats`).
                        let t = Instant::now();
                        let phase = match &m {
                            PeerMsg::CatchUpResp { .. } => {
                                stats.catchup_queue_us.fetch_add(t.saturating_duration_since(decoded).as_micros() as u64, Ordering::Relaxed);
                                Some(&stats.catchup_apply_us)
                            }
                            PeerMsg::CatchUpReq { .. } => Some(&stats.catchup_build_us),
                            _ => None,
                        };
                        core.handle(now, NodeInput::Peer { from, msg: m });
                        if let Some(p) = phase {
                            add_us(p, t);
                        }
                    }
                    Input::Client { id, op, reply } => {
                        let tag = next_tag;
                        next_tag += 1;
                        replies.insert(tag, (reply, id));
                        core.handle(now, NodeInput::Client { tag, op });
                    }
                    Input::Persisted(seqs) => {
                        core.handle(now, NodeInput::Persisted(seqs.into_iter().filter(|(i, _)| *i == inc).map(|(_, s)| s).collect()));
                    }
                    Input::LogRead { to, cursor, chunk } => core.handle(now, NodeInput::LogRead { to, cursor, chunk }),
                }
            }
            _ = std::future::ready(()), if pumping => {}
        }
        if core.wants_pump() {
            last_now = now_us();
            let t = Instant::now();
            core.handle(last_now, NodeInput::Pump);
            add_us(&stats.catchup_build_us, t);
            if !core.serves_catchup() {
                // The Buddy's side of the catch-up (its last chunk is out), for the recovery's
                // breakdown.
                eprintln!(
                    "catch-up served: node {me} since start: chunks_sent {} build_us {} encode_us {} write_us {}",
                    stats.catchup_chunks_sent.load(Ordering::Relaxed),
                    stats.catchup_build_us.load(Ordering::Relaxed),
                    stats.catchup_encode_us.load(Ordering::Relaxed),
                    stats.catchup_write_us.load(Ordering::Relaxed)
                );
            }
        }
        // Carry out outputs in order; a Reload rebuilds the core and continues with its outputs.
        loop {
            let outs = core.take_outputs();
            if outs.is_empty() {
                break;
            }
            // Consecutive appends go to the log thread as one job.
            let mut appends: Vec<(Option<(u64, u64)>, Append)> = Vec::new();
            let flush = |appends: &mut Vec<(Option<(u64, u64)>, Append)>| {
                if !appends.is_empty() {
                    let _ = log_tx.send(LogJob::Append(std::mem::take(appends)));
                }
            };
            for o in outs {
                match o {
                    Output::Persist { seq, rec } => {
                        appends.push((Some((inc, seq)), Append::Rec(rec)));
                        continue;
                    }
                    Output::PersistChunk { seq, puts } => {
                        appends.push((Some((inc, seq)), Append::Chunk(puts)));
                        continue;
                    }
                    Output::Mark(rec) => {
                        appends.push((None, Append::Rec(rec)));
                        continue;
                    }
                    _ => {}
                }
                if matches!(o, Output::ReadLog { .. } | Output::Reload) {
                    flush(&mut appends);
                }
                match o {
                    Output::Persist { .. } | Output::PersistChunk { .. } | Output::Mark(_) => {
                        unreachable!("handled above")
                    }
                    Output::Send { to, msg } => {
                        if let Some(tx) = peer_tx.get(&to) {
                            let _ = tx.try_send(msg);
                        }
                    }
                    Output::ToCm(a) => {
                        if let Some(tx) = &cm_tx {
                            let _ = tx.try_send(NetMsg::HbAck(a));
                        }
                    }
                    Output::ReadLog {
                        to,
                        cursor,
                        max_bytes,
                    } => {
                        let _ = log_tx.send(LogJob::Read {
                            to,
                            cursor,
                            max_bytes,
                        });
                    }
                    Output::Reply { tag, result } => {
                        if let Some((tx, id)) = replies.remove(&tag) {
                            let _ = tx.try_send(NetMsg::Resp { id, result });
                        }
                    }
                    Output::Reload => {
                        tracing::warn!(
                            node = me,
                            "removed from the configuration: reloading from the log to recover"
                        );
                        let (rtx, rrx) = std::sync::mpsc::channel();
                        let as_new = cfg.params.returns_as_new_node(true).then_some(me);
                        let _ = log_tx.send(LogJob::Rebuild(rtx, as_new));
                        let st = tokio::task::block_in_place(|| rrx.recv()).unwrap_or_default();
                        core = NodeCore::new(with_fresh_lease_refs(&cfg.params), st);
                        pmlog::release_free_memory();
                        inc += 1;
                        // Durable completions of the old core are meaningless to the new one.
                    }
                    Output::Recovered(s) => {
                        tracing::info!(
                            node = me,
                            total_ms = s.total_us() as f64 / 1000.0,
                            start_to_ack_us = s.start_to_ack_us,
                            catchup_to_resp_us = s.catchup_to_resp_us,
                            apply_to_end_us = s.apply_to_end_us,
                            entries = s.entries_received,
                            applied = s.entries_applied,
                            full_copy = s.full_copy,
                            "HEAL recovery complete"
                        );
                        // Wall-clock end, so a load generator can place the recovery on its own clock.
                        let ended_unix_us = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .unwrap_or_default()
                            .as_micros();
                        let ld = |c: &AtomicU64| c.load(Ordering::Relaxed);
                        eprintln!(
                            "recovered: node {me} in {:.3} ms (start_to_ack {} us, catchup_to_resp {} us, apply_to_end {} us, transfer {} us, {} entries, {} bytes, {} chunks, full_copy {}, ended_unix_us {ended_unix_us}; window_stall_us {} requests {} request_wait_us {}; since start: log_durable_writes {} log_durable_bytes {} log_durable_us {} log_encode_us {} decode_us {} queue_us {} apply_us {} persisted_us {} idle_us {})",
                            s.total_us() as f64 / 1000.0, s.start_to_ack_us, s.catchup_to_resp_us, s.apply_to_end_us, s.transfer_us, s.entries_received, s.bytes_received, s.chunks, s.full_copy, s.window_stall_us,
                            s.requests, s.request_wait_us,
                            ld(&stats.log_durable_writes), ld(&stats.log_durable_bytes), ld(&stats.log_durable_us), ld(&stats.log_encode_us),
                            ld(&stats.catchup_decode_us), ld(&stats.catchup_queue_us), ld(&stats.catchup_apply_us), ld(&stats.catchup_persisted_us), ld(&stats.recovering_idle_us)
                        );
                        events.append(Event::Recovered {
                            node: me,
                            total_us: s.total_us(),
                            ended_unix_us: ended_unix_us as u64,
                            stats: s.clone(),
                            since_start: SinceStart {
                                log_durable_writes: ld(&stats.log_durable_writes),
                                log_durable_bytes: ld(&stats.log_durable_bytes),
                                log_durable_us: ld(&stats.log_durable_us),
                                log_encode_us: ld(&stats.log_encode_us),
                                catchup_decode_us: ld(&stats.catchup_decode_us),
                                catchup_queue_us: ld(&stats.catchup_queue_us),
                                catchup_apply_us: ld(&stats.catchup_apply_us),
                                catchup_persisted_us: ld(&stats.catchup_persisted_us),
                                recovering_idle_us: ld(&stats.recovering_idle_us),
                            },
                        });
                        stats.recoveries.fetch_add(1, Ordering::Relaxed);
                        *stats.last_recovery.lock().unwrap() = Some(s);
                    }
                }
            }
            flush(&mut appends);
        }
        if stats.epoch.load(Ordering::Relaxed) != core.epoch() {
            tracing::info!(
                node = me,
                epoch = core.epoch(),
                member = core.is_member_mode(),
                recovering = core.is_recovering(),
                serving = core.serving(now_us()),
                "configuration adopted"
            );
        }
        stats.epoch.store(core.epoch(), Ordering::Relaxed);
        stats
            .serving
            .store(core.serving(now_us()) as u64, Ordering::Relaxed);
        stats.keys.store(core.keys() as u64, Ordering::Relaxed);
        stats
            .missed_updates_bytes
            .store(core.missed_updates_bytes() as u64, Ordering::Relaxed);
    }
}

fn render_node_metrics(s: &NodeStats) -> String {
    use wire::metrics::metric;
    let mut out = String::new();
    metric(
        &mut out,
        "kv_epoch",
        "gauge",
        "configuration epoch",
        &[("", s.epoch.load(Ordering::Relaxed) as f64)],
    );
    metric(
        &mut out,
        "kv_serving",
        "gauge",
        "1 if serving clients",
        &[("", s.serving.load(Ordering::Relaxed) as f64)],
    );
    metric(
        &mut out,
        "kv_keys",
        "gauge",
        "keys held",
        &[("", s.keys.load(Ordering::Relaxed) as f64)],
    );
    metric(
        &mut out,
        "kv_missed_updates_bytes",
        "gauge",
        "bytes accounted in the Missed_updates buffer",
        &[("", s.missed_updates_bytes.load(Ordering::Relaxed) as f64)],
    );
    metric(
        &mut out,
        "kv_log_bytes",
        "gauge",
        "bytes in the persistent-memory log file",
        &[("", s.log_bytes.load(Ordering::Relaxed) as f64)],
    );
    metric(
        &mut out,
        "kv_log_compactions_total",
        "counter",
        "log compactions",
        &[("", s.log_compactions.load(Ordering::Relaxed) as f64)],
    );
    metric(
        &mut out,
        "kv_recoveries_total",
        "counter",
        "HEAL recoveries completed",
        &[("", s.recoveries.load(Ordering::Relaxed) as f64)],
    );
    if let Some(r) = s.last_recovery.lock().unwrap().clone() {
        metric(
            &mut out,
            "kv_last_recovery_us",
            "gauge",
            "duration of the last HEAL recovery",
            &[("", r.total_us() as f64)],
        );
    }
    out
}

async fn peer_writer(
    me: NodeId,
    addr: SocketAddr,
    secret: Vec<u8>,
    mut rx: mpsc::Receiver<PeerMsg>,
    stats: Arc<NodeStats>,
) {
    let mut backoff = Duration::from_millis(2);
    loop {
        let conn = async {
            let mut s = TcpStream::connect(addr).await?;
            s.set_nodelay(true)?;
            set_socket_buffer(&s, libc::SO_SNDBUF, PEER_SOCKET_BUFFER_BYTES);
            handshake_client(&mut s, &secret, Hello::Peer(me)).await?;
            Ok::<_, KvError>(s)
        };
        let mut s = match tokio::time::timeout(Duration::from_secs(2), conn).await {
            Ok(Ok(s)) => s,
            _ => {
                // Messages for an unreachable peer are dropped; the protocol retransmits.
                while rx.try_recv().is_ok() {}
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(20));
                continue;
            }
        };
        backoff = Duration::from_millis(2);
        let (_r, mut w) = s.split();
        if let FramesEnd::QueueClosed =
            write_frames(&mut w, &mut rx, NetMsg::Peer, Some(&stats)).await
        {
            return;
        }
    }
}

/// Sets a socket buffer size (`SO_SNDBUF` or `SO_RCVBUF`). Best effort: a refusal only costs
/// speed.
fn set_socket_buffer(s: &TcpStream, opt: libc::c_int, bytes: usize) {
    use std::os::fd::AsRawFd;
    let v = bytes.min(libc::c_int::MAX as usize) as libc::c_int;
    // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from a pointer to a live local c_int;
    // the fd is owned by `s`, which is open for the duration of the call.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            &v as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        tracing::debug!(
            "setsockopt({opt}, {bytes}): {}",
            std::io::Error::last_os_error()
        );
    }
}

enum FramesEnd {
    QueueClosed,
    WriteFailed,
}

/// Writes `rx`'s messages to `w` as frames until the queue closes or a write fails. Whatever is
/// queued goes out in one write (up to about [`CONN_WRITE_BATCH_BYTES`]): a busy connection
/// costs a syscall per batch, not per message. Frames are encoded straight into one reused
/// buffer (a catch-up chunk is about a MiB: no buffer of its own, no copy into the batch).
async fn write_frames<T, W: AsyncWrite + Unpin>(
    w: &mut W,
    rx: &mut mpsc::Receiver<T>,
    wrap: impl Fn(T) -> NetMsg,
    stats: Option<&NodeStats>,
) -> FramesEnd {
    use tokio::io::AsyncWriteExt;
    let mut buf: Vec<u8> = Vec::new();
    // Catch-up chunks are timed (encode, write) for the recovery's breakdown.
    let mut chunks = 0u64;
    let push = |buf: &mut Vec<u8>, m: NetMsg| -> u64 {
        match stats {
            Some(s) if matches!(m, NetMsg::Peer(PeerMsg::CatchUpResp { .. })) => {
                let t = Instant::now();
                push_frame(buf, &m);
                add_us(&s.catchup_encode_us, t);
                1
            }
            _ => {
                push_frame(buf, &m);
                0
            }
        }
    };
    while let Some(m) = rx.recv().await {
        buf.clear();
        chunks += push(&mut buf, wrap(m));
        while buf.len() < CONN_WRITE_BATCH_BYTES {
            let Ok(m) = rx.try_recv() else { break };
            chunks += push(&mut buf, wrap(m));
        }
        let t = Instant::now();
        if w.write_all(&buf).await.is_err() {
            return FramesEnd::WriteFailed;
        }
        if let Some(s) = stats.filter(|_| chunks > 0) {
            add_us(&s.catchup_write_us, t);
            s.catchup_chunks_sent
                .fetch_add(std::mem::take(&mut chunks), Ordering::Relaxed);
        }
        if buf.capacity() > 2 * (CONN_WRITE_BATCH_BYTES + MAX_FRAME_BYTES) {
            buf = Vec::new(); // an outsized batch's memory is not kept
        }
    }
    FramesEnd::QueueClosed
}

/// Appends `msg` to `buf` as one `wire` frame (`len | crc32c | postcard`), encoded in place.
fn push_frame(buf: &mut Vec<u8>, msg: &NetMsg) {
    let start = buf.len();
    buf.extend_from_slice(&[0u8; wire::FRAME_HEADER_BYTES]);
    let taken = std::mem::take(buf);
    // Encoding a NetMsg into a Vec cannot fail.
    *buf = postcard::to_extend(msg, taken).expect("a NetMsg always encodes");
    let body = start + wire::FRAME_HEADER_BYTES;
    let crc = crc32c::crc32c(&buf[body..]);
    let len = (buf.len() - body) as u32;
    buf[start..start + 4].copy_from_slice(&len.to_le_bytes());
    buf[start + 4..body].copy_from_slice(&crc.to_le_bytes());
}

/// Reads one frame into `buf` (its spare capacity: not zeroed first) and decodes it; the same
/// checks as [`wire::read_msg`]. A catch-up chunk keeps the frame's buffer (see
/// [`decode_catchup_resp`]), so the next frame gets a new one; any other frame leaves it for
/// reuse.
async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    limit: usize,
    decode_us: Option<&AtomicU64>,
) -> Result<NetMsg, wire::WireError> {
    use tokio::io::AsyncReadExt;
    let mut header = [0u8; wire::FRAME_HEADER_BYTES];
    match r.read_exact(&mut header).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(wire::WireError::Closed)
        }
        Err(e) => return Err(e.into()),
    }
    let (len, want) = wire::parse_header(&header, limit)?;
    buf.clear();
    buf.reserve(len);
    while buf.len() < len {
        let missing = (len - buf.len()) as u64;
        if (&mut *r).take(missing).read_buf(buf).await? == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
    }
    let t = Instant::now();
    let got = crc32c::crc32c(buf);
    if got != want {
        return Err(wire::WireError::Checksum { got, want });
    }
    let m = decode_net_payload(buf);
    if let (Some(c), Ok(NetMsg::Peer(PeerMsg::CatchUpResp { .. }))) = (decode_us, &m) {
        add_us(c, t);
    }
    m
}

/// Decodes a frame's payload as a node's connection does: a catch-up chunk takes `payload`'s
/// buffer ([`decode_catchup_resp`]), any other message is decoded from it.
pub fn decode_net_payload(payload: &mut Vec<u8>) -> Result<NetMsg, wire::WireError> {
    decode_catchup_resp(payload).unwrap_or_else(|| wire::decode_payload(payload))
}

/// A `CatchUpResp`'s fields in the order `PeerMsg::CatchUpResp` encodes them, its entries
/// borrowed from the frame (checked against the real message by a test).
#[derive(Deserialize)]
struct CatchUpRespHead<'a> {
    epoch: u64,
    stream: u64,
    from: Cursor,
    next: Option<Cursor>,
    full_copy: bool,
    entries: &'a [u8],
}

/// The first two bytes of every encoded `NetMsg::Peer(PeerMsg::CatchUpResp { .. })`: the
/// variant indices (postcard varints, one byte each below 128).
fn catchup_resp_prefix() -> [u8; 2] {
    static PREFIX: std::sync::OnceLock<[u8; 2]> = std::sync::OnceLock::new();
    *PREFIX.get_or_init(|| {
        let sample = NetMsg::Peer(PeerMsg::CatchUpResp {
            epoch: 0,
            stream: 0,
            from: Cursor::Key(None),
            next: None,
            full_copy: false,
            entries: Chunk::default(),
        });
        let b = postcard::to_stdvec(&sample).expect("a NetMsg always encodes");
        assert!(b[0] < 0x80 && b[1] < 0x80, "variant indices of one byte");
        [b[0], b[1]]
    })
}

/// Decodes the payload `frame` if it is a catch-up chunk (`None` otherwise), taking `frame`'s
/// buffer as the chunk's instead of copying a MiB of entries out of it (on a recovering node,
/// decoding took 22–69 ms of a ~50 MB HEAL catch-up with that copy, 2.4–9.1 ms without).
fn decode_catchup_resp(frame: &mut Vec<u8>) -> Option<Result<NetMsg, wire::WireError>> {
    if !frame.starts_with(&catchup_resp_prefix()) {
        return None;
    }
    let head: CatchUpRespHead<'_> = match postcard::from_bytes(&frame[2..]) {
        Ok(h) => h,
        Err(e) => return Some(Err(wire::WireError::Decode(e.to_string()))),
    };
    // The entries are borrowed from `frame`; checked rather than trusted, as a peer's bytes.
    let start = (head.entries.as_ptr() as usize).checked_sub(frame.as_ptr() as usize);
    let Some((start, end)) = start
        .map(|s| (s, s + head.entries.len()))
        .filter(|&(_, end)| end <= frame.len())
    else {
        let e = "catch-up entries outside their frame".to_string();
        return Some(Err(wire::WireError::Decode(e)));
    };
    let CatchUpRespHead {
        epoch,
        stream,
        from,
        next,
        full_copy,
        ..
    } = head;
    let entries = Chunk::in_frame(std::mem::take(frame), start, end);
    Some(Ok(NetMsg::Peer(PeerMsg::CatchUpResp {
        epoch,
        stream,
        from,
        next,
        full_copy,
        entries,
    })))
}

/// `p` for a new core: its acks' lease refs start at the wall clock in microseconds, above every
/// ref an earlier core of this node issued (at most one per heartbeat, far fewer than one per
/// microsecond), so the CM's echo of an old core's ack anchors nothing in the new one.
fn with_fresh_lease_refs(p: &NodeParams) -> NodeParams {
    let mut p = p.clone();
    p.first_lease_ref = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64);
    p
}

async fn serve_conn(
    mut sock: TcpStream,
    secret: Vec<u8>,
    in_tx: mpsc::Sender<Input>,
    hb_tx: mpsc::Sender<(Heartbeat, mpsc::Sender<NetMsg>, Instant)>,
    stats: Arc<NodeStats>,
) {
    if let Err(e) = wire::auth::accept(&mut sock, &secret).await {
        tracing::warn!("refused connection: {e}");
        return;
    }
    let Ok(NetMsg::Hello(hello)) = wire::read_msg::<NetMsg, _>(&mut sock, MAX_FRAME_BYTES).await
    else {
        return;
    };
    if matches!(hello, Hello::Peer(_)) {
        set_socket_buffer(&sock, libc::SO_RCVBUF, PEER_SOCKET_BUFFER_BYTES);
    }
    let (r, mut w) = sock.into_split();
    // Buffered: a busy connection's many small frames are read a buffer at a time, not two
    // syscalls each (a large frame still goes straight into its own buffer).
    let mut r = tokio::io::BufReader::with_capacity(CONN_READ_BUFFER_BYTES, r);
    let (out_tx, mut out_rx) = mpsc::channel::<NetMsg>(CLIENT_INFLIGHT_MAX);
    tokio::spawn(async move { write_frames(&mut w, &mut out_rx, |m| m, None).await });
    let mut frame = Vec::new();
    let decode_us = matches!(hello, Hello::Peer(_)).then_some(&stats.catchup_decode_us);
    loop {
        let m = match read_frame(&mut r, &mut frame, MAX_FRAME_BYTES, decode_us).await {
            Ok(m) => m,
            Err(wire::WireError::Closed) => return,
            Err(e) => {
                tracing::debug!("closing connection: {e}");
                return;
            }
        };
        let inp = match (&hello, m) {
            (Hello::Peer(from), NetMsg::Peer(pm)) => Input::Peer(*from, pm, Instant::now()),
            (Hello::Cm, NetMsg::Hb(hb)) => {
                if hb_tx
                    .send((hb, out_tx.clone(), Instant::now()))
                    .await
                    .is_err()
                {
                    return;
                }
                continue;
            }
            (Hello::Client, NetMsg::Req { id, op }) => Input::Client {
                id,
                op,
                reply: out_tx.clone(),
            },
            _ => return, // a message this kind of peer may not send: drop the connection
        };
        if in_tx.send(inp).await.is_err() {
            return;
        }
    }
}

// ------------------------------------------------------------------------------ CM

#[derive(Clone, Debug)]
pub struct CmConfig {
    pub params: CmParams,
    pub nodes: BTreeMap<NodeId, SocketAddr>,
    pub data_dir: PathBuf,
    pub secret: Vec<u8>,
    pub metrics: Option<SocketAddr>,
}

fn load_cm_state(path: &Path) -> Result<Option<Config>, KvError> {
    match std::fs::read(path) {
        Ok(b) => {
            let (recs, _) = pmlog::decode_all(&b);
            // The state file holds one record: a Put whose value is the postcard configuration.
            for r in recs {
                if let LogRecord::Put { value, .. } = r {
                    return postcard::from_bytes(&value).map(Some).map_err(|e| {
                        KvError::Refused(format!("corrupt CM state {}: {e}", path.display()))
                    });
                }
            }
            Err(KvError::Refused(format!(
                "corrupt CM state {}: no record",
                path.display()
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn save_cm_state(path: &Path, c: &Config) -> Result<(), KvError> {
    use std::io::Write;
    let rec = LogRecord::Put {
        key: b"config".to_vec(),
        ts: Ts::default(),
        value: postcard::to_allocvec(c).expect("config encodes"),
    };
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&pmlog::encode(&rec))?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Runs the configuration manager until the process is stopped.
pub async fn run_cm(cfg: CmConfig) -> Result<(), KvError> {
    std::fs::create_dir_all(&cfg.data_dir)?;
    let state_path = cfg.data_dir.join("cm.state");
    let durable = load_cm_state(&state_path)?;
    if let Some(c) = &durable {
        tracing::info!(
            epoch = c.epoch,
            "CM restarting from its durable configuration"
        );
    }
    let start = Instant::now();
    let now_us = || start.elapsed().as_micros() as u64;
    let mut cm = CmCore::new(
        cfg.params.clone(),
        durable,
        cfg.nodes.len() as u32,
        now_us(),
    );
    let (ack_tx, mut ack_rx) = mpsc::channel::<HeartbeatAck>(65_536);
    let mut hb_tx: HashMap<NodeId, mpsc::Sender<Heartbeat>> = HashMap::new();
    for (&id, &addr) in &cfg.nodes {
        let (tx, rx) = mpsc::channel(64);
        hb_tx.insert(id, tx);
        tokio::spawn(cm_link(addr, cfg.secret.clone(), rx, ack_tx.clone()));
    }
    let epoch = Arc::new(AtomicU64::new(0));
    if let Some(m) = cfg.metrics {
        let l = TcpListener::bind(m).await?;
        let epoch = epoch.clone();
        tokio::spawn(wire::metrics::serve(l, move || {
            let e = epoch.load(Ordering::Relaxed);
            async move {
                let mut out = String::new();
                wire::metrics::metric(
                    &mut out,
                    "kv_cm_epoch",
                    "gauge",
                    "configuration epoch",
                    &[("", e as f64)],
                );
                out
            }
        }));
    }
    let mut tick = tokio::time::interval(Duration::from_micros(
        cfg.params.heartbeat_interval_us.max(1000),
    ));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = tick.tick() => cm.handle(now_us(), CmInput::Tick),
            Some(a) = ack_rx.recv() => cm.handle(now_us(), CmInput::Ack(a)),
        }
        for o in cm.take_outputs() {
            match o {
                CmOutput::Persist(c) => {
                    save_cm_state(&state_path, &c)?;
                    epoch.store(c.epoch, Ordering::Relaxed);
                }
                CmOutput::Send { to, hb } => {
                    if let Some(tx) = hb_tx.get(&to) {
                        let _ = tx.try_send(hb);
                    }
                }
                CmOutput::Note(n) => {
                    tracing::info!("{n}");
                    eprintln!("cm: {n}");
                }
            }
        }
    }
}

async fn cm_link(
    addr: SocketAddr,
    secret: Vec<u8>,
    mut rx: mpsc::Receiver<Heartbeat>,
    acks: mpsc::Sender<HeartbeatAck>,
) {
    loop {
        let conn = async {
            let mut s = TcpStream::connect(addr).await?;
            s.set_nodelay(true)?;
            handshake_client(&mut s, &secret, Hello::Cm).await?;
            Ok::<_, KvError>(s)
        };
        let s = match tokio::time::timeout(Duration::from_secs(1), conn).await {
            Ok(Ok(s)) => s,
            _ => {
                while rx.try_recv().is_ok() {}
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let (mut r, mut w) = s.into_split();
        let acks2 = acks.clone();
        let reader = tokio::spawn(async move {
            while let Ok(NetMsg::HbAck(a)) =
                wire::read_msg::<NetMsg, _>(&mut r, MAX_FRAME_BYTES).await
            {
                if acks2.send(a).await.is_err() {
                    return;
                }
            }
        });
        loop {
            tokio::select! {
                m = rx.recv() => {
                    let Some(hb) = m else { reader.abort(); return };
                    if wire::write_msg(&mut w, &NetMsg::Hb(hb)).await.is_err() { break; }
                }
                _ = tokio::time::sleep(Duration::from_secs(1)), if reader.is_finished() => break,
            }
            if reader.is_finished() {
                break;
            }
        }
        reader.abort();
    }
}

// ------------------------------------------------------------------------------ client

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<ClientResult>>>>;

/// A connection to one node, with many requests in flight. Cheap to clone.
#[derive(Clone)]
pub struct KvClient {
    tx: mpsc::Sender<NetMsg>,
    pending: Pending,
    next: Arc<AtomicU64>,
    pub addr: SocketAddr,
    pub timeout: Duration,
}

impl KvClient {
    pub async fn connect(addr: SocketAddr, secret: &[u8]) -> Result<Self, KvError> {
        // The handshake is bounded too: whatever listens there may never answer it.
        let s = tokio::time::timeout(Duration::from_secs(2), async {
            let mut s = TcpStream::connect(addr).await?;
            s.set_nodelay(true)?;
            handshake_client(&mut s, secret, Hello::Client).await?;
            Ok::<_, KvError>(s)
        })
        .await
        .map_err(|_| KvError::Unavailable(format!("connecting to {addr} timed out")))??;
        let (r, mut w) = s.into_split();
        let mut r = tokio::io::BufReader::with_capacity(CONN_READ_BUFFER_BYTES, r);
        let (tx, mut rx) = mpsc::channel::<NetMsg>(CLIENT_INFLIGHT_MAX);
        let pending: Pending = Arc::new(Mutex::new(HashMap::new()));
        tokio::spawn(async move { write_frames(&mut w, &mut rx, |m| m, None).await });
        let p2 = pending.clone();
        tokio::spawn(async move {
            while let Ok(NetMsg::Resp { id, result }) =
                wire::read_msg::<NetMsg, _>(&mut r, MAX_FRAME_BYTES).await
            {
                if let Some(tx) = p2.lock().unwrap().remove(&id) {
                    let _ = tx.send(result);
                }
            }
            // Connection gone: fail everything still waiting.
            p2.lock().unwrap().clear();
        });
        Ok(KvClient {
            tx,
            pending,
            next: Arc::new(AtomicU64::new(1)),
            addr,
            timeout: Duration::from_secs(5),
        })
    }

    /// Sends one operation and waits for its answer.
    pub async fn call(&self, op: ClientOp) -> Result<ClientResult, KvError> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(id, tx);
        if self.tx.send(NetMsg::Req { id, op }).await.is_err() {
            self.pending.lock().unwrap().remove(&id);
            return Err(KvError::Unavailable(format!(
                "connection to {} closed",
                self.addr
            )));
        }
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(_)) => Err(KvError::Unavailable(format!(
                "connection to {} lost",
                self.addr
            ))),
            Err(_) => {
                self.pending.lock().unwrap().remove(&id);
                Err(KvError::Timeout(self.timeout))
            }
        }
    }

    pub async fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        match self.call(ClientOp::Get { key: key.to_vec() }).await? {
            ClientResult::Value(v) => Ok(v),
            other => Err(refusal(other)),
        }
    }

    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        match self
            .call(ClientOp::Put {
                key: key.to_vec(),
                value: value.to_vec(),
                scope: None,
            })
            .await?
        {
            ClientResult::Done => Ok(()),
            other => Err(refusal(other)),
        }
    }

    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

fn refusal(r: ClientResult) -> KvError {
    match r {
        ClientResult::NotServing => KvError::Refused("node not serving".into()),
        ClientResult::Busy => KvError::Refused("node busy".into()),
        ClientResult::Invalid(e) => KvError::Refused(e),
        other => KvError::Refused(format!("unexpected answer {other:?}")),
    }
}

/// A client of a whole group: sends each operation to a node (round robin), and moves on to the
/// next node when one is not serving or unreachable. A node that was unreachable is skipped for
/// [`UNREACHABLE_SKIP_MS`], one that refused for [`REFUSED_SKIP_MS`] (unless every node is
/// skipped), so a dead or recovering node costs its clients one failed try, not one per
/// round. Safe to share among many tasks.
#[derive(Clone)]
pub struct KvCluster {
    addrs: Vec<SocketAddr>,
    secret: Vec<u8>,
    conns: Arc<tokio::sync::Mutex<Vec<Option<KvClient>>>>,
    rr: Arc<AtomicU64>,
    /// Per node: skip it until this many milliseconds after `born`.
    skip_until_ms: Arc<Vec<AtomicU64>>,
    born: Instant,
    /// Give up after this long of retrying across nodes.
    pub deadline: Duration,
}

/// How long a client skips a node it could not reach.
pub const UNREACHABLE_SKIP_MS: u64 = 200;
/// How long a client skips a node that refused (not serving: recovering, or without a lease).
pub const REFUSED_SKIP_MS: u64 = 20;

impl KvCluster {
    pub fn new(addrs: Vec<SocketAddr>, secret: Vec<u8>) -> Self {
        let n = addrs.len();
        KvCluster {
            addrs,
            secret,
            conns: Arc::new(tokio::sync::Mutex::new(vec![None; n])),
            rr: Arc::new(AtomicU64::new(0)),
            skip_until_ms: Arc::new((0..n).map(|_| AtomicU64::new(0)).collect()),
            born: Instant::now(),
            deadline: Duration::from_secs(20),
        }
    }

    /// The next node in round-robin order that is not being skipped (any, if all are).
    fn pick(&self) -> usize {
        let n = self.addrs.len();
        let now = self.born.elapsed().as_millis() as u64;
        let first = self.rr.fetch_add(1, Ordering::Relaxed) as usize;
        (0..n)
            .map(|k| (first + k) % n)
            .find(|&i| self.skip_until_ms[i].load(Ordering::Relaxed) <= now)
            .unwrap_or(first % n)
    }

    fn skip(&self, i: usize, ms: u64) {
        let until = self.born.elapsed().as_millis() as u64 + ms;
        self.skip_until_ms[i].fetch_max(until, Ordering::Relaxed);
    }

    async fn conn(&self, i: usize) -> Result<KvClient, KvError> {
        let mut g = self.conns.lock().await;
        if let Some(c) = &g[i] {
            if !c.is_closed() {
                return Ok(c.clone());
            }
        }
        let c = KvClient::connect(self.addrs[i], &self.secret).await?;
        g[i] = Some(c.clone());
        Ok(c)
    }

    /// Runs `op`, retrying elsewhere while nodes refuse it (refusals guarantee nothing was done).
    /// A timeout is returned as is: the write may or may not have happened.
    pub async fn call(&self, op: ClientOp) -> Result<ClientResult, KvError> {
        let start = Instant::now();
        let mut last;
        let mut tries = 0usize;
        loop {
            let i = self.pick();
            match self.conn(i).await {
                Ok(c) => match c.call(op.clone()).await {
                    Ok(ClientResult::NotServing) | Ok(ClientResult::Busy) => {
                        self.skip(i, REFUSED_SKIP_MS);
                        last = format!("{} not serving", self.addrs[i]);
                    }
                    Ok(r) => return Ok(r),
                    Err(KvError::Timeout(d)) => return Err(KvError::Timeout(d)),
                    Err(e) => {
                        // The request may have reached the node if it was a write; only
                        // connection-level failures before sending are safe to retry, and those
                        // show up as Unavailable from `send` — treat a lost connection as unknown.
                        if matches!(op, ClientOp::Put { .. })
                            && matches!(e, KvError::Unavailable(ref s) if s.contains("lost"))
                        {
                            return Err(e);
                        }
                        last = e.to_string();
                        self.conns.lock().await[i] = None;
                        self.skip(i, UNREACHABLE_SKIP_MS);
                    }
                },
                Err(e) => {
                    last = e.to_string();
                    self.skip(i, UNREACHABLE_SKIP_MS);
                }
            }
            if start.elapsed() > self.deadline {
                return Err(KvError::Unavailable(last));
            }
            // Straight on to the next node; a pause once every node has been tried.
            tries += 1;
            if tries.is_multiple_of(self.addrs.len()) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }

    pub async fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        match self.call(ClientOp::Get { key: key.to_vec() }).await? {
            ClientResult::Value(v) => Ok(v),
            other => Err(refusal(other)),
        }
    }

    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        match self
            .call(ClientOp::Put {
                key: key.to_vec(),
                value: value.to_vec(),
                scope: None,
            })
            .await?
        {
            ClientResult::Done => Ok(()),
            other => Err(refusal(other)),
        }
    }
}

/// The file `kv up` writes so that clients find the group.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct KvClusterFile {
    pub model: String,
    pub nodes: BTreeMap<NodeId, SocketAddr>,
    pub secret_file: PathBuf,
}
