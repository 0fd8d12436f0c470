//! The witness-KV node server: one tokio task owns the [`WitnessCore`] and is the only place
//! its inputs are given; network readers, the I/O thread and the timer only queue inputs.
//!
//! Why this shape:
//! - **Peer messages before client requests** (two queues, the peer one polled first): a node
//!   busy with clients must still hear heartbeats and acks, or it looks dead and a needless
//!   election starts (HEAL's heartbeat-first input, for the same reason).
//! - **pmem appends inline** on the core's task: in shm mode an append is a copy and a fence
//!   (µs), so a thread hop would cost more than the append. `PmemPersisted{seq}` is fed back
//!   after the whole batch of outputs is carried out (the core defers every send that must wait
//!   for a durable term or vote, so nothing leaves before it is durable). `--pmem dsync` would
//!   belong on a thread: not offered by this driver yet.
//! - **SSD I/O through `store::io::IoPool`**: the core's writes, reads and frees (segments and
//!   offsets it chose, in its one page format) go to the pool in the core's priority class, so a
//!   PriorityPull overtakes queued writeback, BatchPull and GC. The pool may reorder requests;
//!   the core never depends on an order: it reads only what is durable (index locations, a
//!   segment's durable prefix) and frees only a segment nothing reads or references.
//!
//! Durable layout in the node's directories: `<shm>/meta.pmem` (term/vote records),
//! `<shm>/log.pmem` (the head's log or the backup's buffer, with truncation markers), and
//! `<data>/{hot,cold}-<id>.seg` (`store::ssdlog`). A node started on existing files is rebuilt
//! with [`WitnessCore::restore`].

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::*;
use crate::witness::core::config::Config;
use crate::witness::core::node::{
    Durable, Input, Output, Params, PmemRecord, Region, RoleKind, WitnessCore,
};
use crate::witness::proto::{Entry, StatusReport};
use crate::witness::store::io::{IoClass, IoCompletion, IoConfig, IoOp, IoOutput, IoPool, IoRequest, IoSubmitter};
use crate::witness::store::pmem::{PmemConfig, PmemMode, PmemRegion};
use crate::witness::store::ssdlog::{SsdConfig, SsdLogs};

/// Messages queued per outbound peer connection before new ones are dropped (the protocol
/// retransmits on its heartbeat).
pub const PEER_QUEUE_MSGS: usize = 16_384;
/// Peer messages queued for the core; past it readers wait (TCP pushes back on the sender).
pub const PEER_INPUT_QUEUE_MSGS: usize = 8192;
/// Client requests queued for the core.
pub const CLIENT_INPUT_QUEUE_MSGS: usize = 4096;
/// Replies queued to one client connection (= requests it may have in flight).
pub const CLIENT_INFLIGHT_MAX: usize = 1024;
/// Client requests given to the core and not answered yet. A leader that cannot commit (a
/// voting backup down) holds its puts; past this bound new requests are answered `Unavailable`
/// at once instead of growing the core's pending set and this map without end.
pub const PENDING_CLIENT_CALLS_MAX: usize = 16_384;
/// SSD completions queued for the core. The core bounds its own reads and writebacks, so the
/// pool's request channel is only a backstop; a full one blocks the core's task (backpressure,
/// no loss).
pub const SSD_QUEUE_REQS: usize = 1024;
/// An input (with the outputs it makes) that holds the node's one task this long is logged.
pub const SLOW_INPUT: Duration = Duration::from_millis(20);
/// Ring size of the meta region (term/vote records; the old ones are freed at each append).
pub const META_PMEM_BYTES: u64 = 1 << 20;
/// Default ring size of the log region (a head's key-only log, a backup's buffer).
pub const LOG_PMEM_BYTES_DEFAULT: u64 = 256 << 20;

pub struct WitnessNodeConfig {
    pub id: NodeId,
    pub cfg: Config,
    pub params: Params,
    pub listen: SocketAddr,
    /// Every member's address (this node's own included).
    pub peers: BTreeMap<NodeId, SocketAddr>,
    /// SSD logs (must support O_DIRECT: not tmpfs).
    pub data_dir: PathBuf,
    /// NVMM regions (default: a directory in /dev/shm).
    pub pmem_dir: PathBuf,
    pub pmem_log_bytes: u64,
    pub secret: Vec<u8>,
}

/// A driver record in the log region: the core's record, or a truncation the core asked for
/// (a ring cannot drop its tail, so the drop is itself a record replayed at restart).
const REC_CORE: u8 = 0;
const REC_TRUNCATE: u8 = 1;

struct Pmem {
    meta: PmemRegion,
    meta_seq: u64,
    log: PmemRegion,
    log_seq: u64,
    /// Live entry records of the log region in ring order: (ring seq, entry index), so that
    /// `PmemFree{through_index}` maps to a ring prefix.
    live: VecDeque<(u64, u64)>,
}

impl Pmem {
    fn open(dir: &std::path::Path, log_bytes: u64) -> Result<(Pmem, Durable), WitnessError> {
        std::fs::create_dir_all(dir)?;
        let cfg = |cap| PmemConfig {
            mode: PmemMode::Shm,
            capacity_bytes: cap,
            persist_ns: 0,
        };
        let meta = PmemRegion::open(&dir.join("meta.pmem"), &cfg(META_PMEM_BYTES))?;
        let log = PmemRegion::open(&dir.join("log.pmem"), &cfg(log_bytes))?;
        let mut durable = Durable::default();
        for (_, rec) in meta.iter() {
            if let Some(PmemRecord::Meta { term, voted_for }) = decode_core(rec) {
                durable.meta = Some((term, voted_for));
            }
        }
        let mut entries: Vec<(u64, Entry)> = Vec::new();
        for (seq, rec) in log.iter() {
            match rec.first() {
                Some(&REC_CORE) => {
                    if let Some(PmemRecord::Entry(e)) = decode_core(rec) {
                        entries.retain(|(_, x)| x.index < e.index);
                        entries.push((seq, e));
                    }
                }
                Some(&REC_TRUNCATE) if rec.len() == 9 => {
                    let from = u64::from_le_bytes(rec[1..9].try_into().unwrap());
                    entries.retain(|(_, x)| x.index < from);
                }
                _ => return Err(WitnessError::Restore(format!("unknown pmem record at seq {seq}"))),
            }
        }
        let pm = Pmem {
            meta_seq: meta.last_seq().unwrap_or(0),
            log_seq: log.last_seq().unwrap_or(0),
            meta,
            log,
            live: entries.iter().map(|(s, e)| (*s, e.index)).collect(),
        };
        durable.entries = entries.into_iter().map(|(_, e)| e).collect();
        Ok((pm, durable))
    }

    fn append(&mut self, region: Region, rec: &[u8]) -> Result<(), WitnessError> {
        let mut framed = Vec::with_capacity(rec.len() + 1);
        framed.push(REC_CORE);
        framed.extend_from_slice(rec);
        if region == Region::Meta {
            self.meta_seq += 1;
            self.meta.append(self.meta_seq, &framed)?;
            // Only the newest term/vote matters.
            self.meta.truncate_through(self.meta_seq - 1)?;
            return Ok(());
        }
        self.log_seq += 1;
        self.log.append(self.log_seq, &framed)?;
        if let Some(PmemRecord::Entry(e)) = decode_core(&framed) {
            self.live.push_back((self.log_seq, e.index));
        }
        Ok(())
    }

    fn truncate(&mut self, from_index: u64) -> Result<(), WitnessError> {
        let mut rec = vec![REC_TRUNCATE];
        rec.extend_from_slice(&from_index.to_le_bytes());
        self.log_seq += 1;
        self.log.append(self.log_seq, &rec)?;
        self.live.retain(|(_, i)| *i < from_index);
        Ok(())
    }

    fn free(&mut self, through_index: u64) -> Result<(), WitnessError> {
        let mut upto = None;
        while let Some(&(s, i)) = self.live.front() {
            if i > through_index {
                break;
            }
            upto = Some(s);
            self.live.pop_front();
        }
        // The ring frees a prefix: any truncation marker or dropped record before `upto` only
        // concerned records that are older still.
        if let Some(s) = upto {
            self.log.truncate_through(s)?;
        }
        Ok(())
    }
}

impl Pmem {
    /// The driver's part of a status reply: the NVMM rings and the process's resident set.
    fn fill_status(&self, st: &mut StatusReport) {
        st.tiers.nvmm_buffer_used_bytes = self.log.used_bytes() + self.meta.used_bytes();
        st.tiers.nvmm_buffer_mapped_bytes = self.log.capacity_bytes() + self.meta.capacity_bytes();
        if let Some((rss, shared)) = statm_rss_bytes() {
            st.rss_bytes = rss;
            st.rss_shared_bytes = shared;
        }
    }
}

/// This process's resident and shared bytes, from `/proc/self/statm` (pages: size resident
/// shared ...). `None` off Linux or if the file is unreadable: the status still answers.
pub fn statm_rss_bytes() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let mut f = s.split_whitespace().skip(1).map(|x| x.parse::<u64>().ok());
    let (rss, shared) = (f.next()??, f.next()??);
    // SAFETY: sysconf has no preconditions; it only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = if page > 0 { page as u64 } else { 4096 };
    Some((rss * page, shared * page))
}

fn decode_core(rec: &[u8]) -> Option<PmemRecord> {
    match rec.split_first() {
        Some((&REC_CORE, body)) => postcard::from_bytes(body).ok(),
        _ => None,
    }
}

/// What a pool request was, in the low bits of its id (the core's io id above them): a
/// completion must become the right input, an error included.
const OP_READ: u64 = 0;
const OP_WRITE: u64 = 1;
const OP_FREE: u64 = 2;

/// Opens the SSD logs (refusing a memory file system: O_DIRECT reads from RAM would be fiction)
/// and returns them with the segments found, for a restart.
fn open_ssd(dir: &std::path::Path) -> Result<(SsdLogs, Vec<crate::witness::core::node::DurableSeg>), WitnessError> {
    if let Some(fs) = crate::witness::store::ssdlog::memory_fs(dir) {
        return Err(WitnessError::Config(format!(
            "{} is on {fs}: the SSD tier needs a disk (O_DIRECT reads from memory would be fiction)",
            dir.display()
        )));
    }
    SsdLogs::open(dir, SsdConfig::default()).map_err(|e| WitnessError::Config(e.to_string()))
}

/// The request a core SSD output becomes.
fn io_request(o: Output) -> Option<IoRequest> {
    Some(match o {
        Output::SsdWrite { id, seg, log, off, bytes, class } => IoRequest {
            id: id << 2 | OP_WRITE,
            class,
            op: IoOp::Write { seg, kind: log, off, bytes },
        },
        Output::SsdRead { id, seg, off, len, class } => IoRequest {
            id: id << 2 | OP_READ,
            class,
            op: IoOp::Read { seg, off, len: len as usize },
        },
        Output::SsdFree { seg } => IoRequest {
            id: seg << 2 | OP_FREE,
            class: IoClass::Gc,
            op: IoOp::Delete { seg },
        },
        _ => return None,
    })
}

/// The input a pool completion becomes (none for a free).
fn io_input(c: IoCompletion) -> Option<Input> {
    let id = c.id >> 2;
    match (c.id & 3, c.result) {
        (OP_READ, Ok(IoOutput::Read(buf))) => Some(Input::SsdRead { id, result: Ok(buf.to_vec()) }),
        (OP_READ, Err(e)) => Some(Input::SsdRead { id, result: Err(e.to_string()) }),
        (OP_WRITE, Ok(_)) => Some(Input::SsdWritten { id, result: Ok(()) }),
        (OP_WRITE, Err(e)) => Some(Input::SsdWritten { id, result: Err(e.to_string()) }),
        (OP_FREE, Err(e)) => {
            // The core forgot the segment: a file left behind is only wasted space, and a
            // restart scans it as garbage (its entries are older or equal copies).
            tracing::warn!("freeing SSD segment {id}: {e}");
            None
        }
        _ => None,
    }
}

/// What a node reports about itself, for status lines and tests.
#[derive(Clone, Debug)]
pub struct NodeStatus {
    pub role: RoleKind,
    pub term: u64,
    pub commit: u64,
    pub serving: bool,
    pub missing_keys: usize,
}

struct ClientCall {
    conn: mpsc::Sender<NetMsg>,
    id: u64,
}

/// Runs the node until an error (or forever; the caller selects on a shutdown signal).
pub async fn run_node(cfg: WitnessNodeConfig) -> Result<(), WitnessError> {
    let me = cfg.id;
    let (mut pmem, durable) = Pmem::open(&cfg.pmem_dir, cfg.pmem_log_bytes)?;
    let (ssd, segs) = open_ssd(&cfg.data_dir)?;
    let t0 = Instant::now();
    let now_us = move || t0.elapsed().as_micros() as u64;
    let fresh = durable.meta.is_none() && durable.entries.is_empty();
    let mut core = if fresh && segs.is_empty() {
        WitnessCore::new(me, cfg.cfg.clone(), cfg.params.clone(), now_us())
            .map_err(|e| WitnessError::Config(e.to_string()))?
    } else {
        let durable = Durable { ssd: segs, ..durable };
        tracing::info!(
            "node {me}: restoring from its tiers ({} log records)",
            durable.entries.len()
        );
        WitnessCore::restore(me, cfg.cfg.clone(), cfg.params.clone(), now_us(), durable)
            .map_err(|e| WitnessError::Restore(e.to_string()))?
    };

    let listener = TcpListener::bind(cfg.listen).await?;
    let (peer_in_tx, mut peer_in) = mpsc::channel::<(NodeId, PeerMsg)>(PEER_INPUT_QUEUE_MSGS);
    let (client_in_tx, mut client_in) =
        mpsc::channel::<(mpsc::Sender<NetMsg>, u64, ClientReq)>(CLIENT_INPUT_QUEUE_MSGS);
    let (ssd_done_tx, mut ssd_done) = mpsc::channel::<Input>(SSD_QUEUE_REQS);
    let (ssd_tx, pool_done, _pool) = IoPool::spawn(Arc::new(ssd), IoConfig::default());
    // The pool speaks std channels: one plain thread forwards its completions to the core's.
    std::thread::Builder::new()
        .name(format!("witness-ssd-{me}"))
        .spawn(move || {
            for c in pool_done.iter() {
                if let Some(i) = io_input(c) {
                    if ssd_done_tx.blocking_send(i).is_err() {
                        return; // the node is stopping
                    }
                }
            }
        })?;

    let mut peer_tx: HashMap<NodeId, mpsc::Sender<PeerMsg>> = HashMap::new();
    for (&id, &addr) in cfg.peers.iter().filter(|(&id, _)| id != me) {
        let (tx, rx) = mpsc::channel(PEER_QUEUE_MSGS);
        peer_tx.insert(id, tx);
        tokio::spawn(peer_writer(me, addr, cfg.secret.clone(), rx));
    }
    let secret = Arc::new(cfg.secret.clone());
    let members: Arc<Vec<NodeId>> = Arc::new(cfg.peers.keys().copied().collect());
    tokio::spawn(wire::listen::serve(
        listener,
        format!("witness node {me}"),
        move |sock, _| {
            serve_conn(
                sock,
                secret.clone(),
                members.clone(),
                peer_in_tx.clone(),
                client_in_tx.clone(),
            )
        },
    ));

    let mut calls: HashMap<u64, ClientCall> = HashMap::new();
    let mut next_tag = 1u64;
    let tick_us = (cfg.params.heartbeat_us / 2).max(1_000);
    let mut tick = tokio::time::interval(Duration::from_micros(tick_us));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_role = None;
    let mut last_proactive = (0u64, 0u64);
    let mut last_step_downs = 0u64;
    let mut last_values_dropped = 0u64;
    loop {
        let input = tokio::select! {
            biased;
            Some((from, msg)) = peer_in.recv() => Input::Peer { from, msg },
            Some(i) = ssd_done.recv() => i,
            _ = tick.tick() => Input::Tick,
            Some((conn, id, req)) = client_in.recv() => {
                if calls.len() >= PENDING_CLIENT_CALLS_MAX {
                    let _ = conn.try_send(NetMsg::Resp { id, reply: ClientReply::Unavailable });
                    continue;
                }
                let tag = next_tag;
                next_tag += 1;
                calls.insert(tag, ClientCall { conn, id });
                Input::Client { tag, req }
            }
        };
        let label = match &input {
            Input::Peer { msg, .. } => msg.body.name(),
            Input::Client { .. } => "client request",
            Input::PmemPersisted { .. } => "pmem persisted",
            Input::SsdWritten { .. } => "ssd write done",
            Input::SsdRead { .. } => "ssd read done",
            Input::Tick => "tick",
            Input::Reconfigure(_) => "reconfigure",
        };
        let started = Instant::now();
        core.handle(now_us(), input);
        // Soft timeouts in the log: operators (and the SIGSTOP tests) see false ones abort.
        let proactive = (core.counters.proactive_started, core.counters.proactive_aborted);
        if proactive != last_proactive {
            if proactive.0 > last_proactive.0 {
                tracing::info!("node {me}: soft timeout: proactive pull started");
            }
            if proactive.1 > last_proactive.1 {
                tracing::info!("node {me}: the leader was heard again: proactive pull aborted");
                give_back_freed_memory();
            }
            last_proactive = proactive;
        }
        if core.counters.quorum_lost_step_downs != last_step_downs {
            last_step_downs = core.counters.quorum_lost_step_downs;
            tracing::warn!("node {me}: stepped down: no quorum renewed the lease for an election timeout");
        }
        if core.counters.values_dropped_as_witness > last_values_dropped {
            last_values_dropped = core.counters.values_dropped_as_witness;
            give_back_freed_memory();
        }
        // Carry the outputs out in order; pmem is durable on return, so its completions are
        // given after the batch, which may produce more outputs (deferred sends).
        loop {
            let outs = core.take_outputs();
            if outs.is_empty() {
                break;
            }
            let mut persisted = None;
            for o in outs {
                match o {
                    Output::Send { to, msg } => {
                        if let Some(tx) = peer_tx.get(&to) {
                            // A full queue drops: the core retransmits on its heartbeat.
                            let _ = tx.try_send(msg);
                        }
                    }
                    Output::PmemAppend { seq, region, rec } => {
                        // A failed append (a full buffer: writeback is behind) stops the node:
                        // reporting later seqs persisted would claim this one durable too.
                        pmem.append(region, &rec)?;
                        persisted = Some(seq);
                    }
                    Output::PmemTruncate { from_index, .. } => pmem.truncate(from_index)?,
                    Output::PmemFree { through_index, .. } => pmem.free(through_index)?,
                    o @ (Output::SsdWrite { .. } | Output::SsdRead { .. } | Output::SsdFree { .. }) => {
                        send_ssd(&ssd_tx, io_request(o).expect("an SSD output")).await?
                    }
                    Output::Reply { tag, mut reply } => {
                        if let ClientReply::Status(st) = &mut reply {
                            pmem.fill_status(st);
                        }
                        if let Some(c) = calls.remove(&tag) {
                            // A gone or stuck client loses only its own reply.
                            let _ = c.conn.try_send(NetMsg::Resp { id: c.id, reply });
                        }
                    }
                    Output::Role { term, role, leader } => {
                        if last_role != Some((term, role)) {
                            tracing::info!("node {me}: term {term} {role:?} (leader {leader:?})");
                            last_role = Some((term, role));
                        }
                    }
                    Output::Recovered(s) => tracing::info!(
                        "node {me}: recovered: {} keys missing at start, {} proactively pulled, {} batch entries, {} priority pulls (mean {:.2} ms, max {:.1} ms), {} gets hit and {} after a pull, BatchPull rate now {} MiB/s, {:.1} ms",
                        s.missing_at_start,
                        s.proactive_installed,
                        s.batch_entries,
                        s.priority_pulls,
                        s.priority_pull_latency_us_total as f64 / s.priority_pulls_answered.max(1) as f64 / 1000.0,
                        s.priority_pull_latency_us_max as f64 / 1000.0,
                        s.gets_hit,
                        s.gets_served_after_pull,
                        match core.batch_pull_rate_bytes_per_s() {
                            u64::MAX => "unlimited".to_string(),
                            r => (r >> 20).to_string(),
                        },
                        s.finished_us.saturating_sub(s.started_us) as f64 / 1000.0
                    ),
                }
            }
            if let Some(seq) = persisted {
                core.handle(now_us(), Input::PmemPersisted { seq });
            }
        }
        let took = started.elapsed();
        if took >= SLOW_INPUT {
            // Everything queued behind this input waited as long: a heartbeat ack late by more
            // than the lease's slack costs the leader its lease. Named so it can be found.
            tracing::warn!("node {me}: one input ({label}) took {} ms", took.as_millis());
        }
    }
}

/// After the core drops a large table at once (an old primary's values, M24: the shard's size;
/// an aborted proactive pull: up to `proactive_bytes_max`), hands the freed pages back to the
/// system. glibc keeps freed chunks below the heap top and in its thread arenas, so without
/// this a witness that once led keeps the whole value table resident (bench kv ttr measured
/// 566 MiB private against 60 MiB accounted), and RSS stops saying what the node holds. On a
/// thread of its own: a trim walks the free lists and may take milliseconds on a large heap;
/// malloc_trim takes the arena locks itself, so it is safe beside the core's task.
fn give_back_freed_memory() {
    let _ = std::thread::Builder::new()
        .name("witness-trim".into())
        .spawn(|| {
            // SAFETY: malloc_trim has no preconditions; it only releases free heap pages.
            unsafe { libc::malloc_trim(0) };
        });
}

async fn send_ssd(tx: &IoSubmitter, req: IoRequest) -> Result<(), WitnessError> {
    let Err(req) = tx.try_submit(req) else {
        return Ok(());
    };
    // The request channel is full: wait for room on a blocking thread (backpressure).
    let tx = tx.clone();
    tokio::task::spawn_blocking(move || tx.submit(req))
        .await
        .map_err(|e| WitnessError::Io(std::io::Error::other(e)))?
        .map_err(|_| WitnessError::Io(std::io::Error::other("the SSD I/O pool stopped")))
}

pub(super) async fn dial(addr: SocketAddr, secret: &[u8], hello: Hello) -> Result<wire::link::Link, WitnessError> {
    let s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let mut s = wire::link::connect(s, wire::link::process()?).await?;
    wire::auth::connect(&mut s, secret).await?;
    wire::write_msg(&mut s, &NetMsg::Hello(hello)).await?;
    tokio::io::AsyncWriteExt::flush(&mut s).await?;
    Ok(s)
}

async fn peer_writer(me: NodeId, addr: SocketAddr, secret: Vec<u8>, mut rx: mpsc::Receiver<PeerMsg>) {
    use tokio::io::AsyncWriteExt;
    let mut backoff = Duration::from_millis(2);
    loop {
        let s = match tokio::time::timeout(Duration::from_secs(2), dial(addr, &secret, Hello::Peer(me))).await {
            Ok(Ok(s)) => s,
            _ => {
                // Messages for an unreachable peer are dropped; the protocol retransmits.
                while rx.try_recv().is_ok() {}
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(50));
                continue;
            }
        };
        backoff = Duration::from_millis(2);
        let (_r, mut w) = s.into_split();
        let mut buf = Vec::new();
        loop {
            let Some(m) = rx.recv().await else { return };
            buf.clear();
            push_frame(&mut buf, &NetMsg::Peer(m));
            // Whatever else is queued goes out in the same write.
            while buf.len() < (1 << 20) {
                let Ok(m) = rx.try_recv() else { break };
                push_frame(&mut buf, &NetMsg::Peer(m));
            }
            if w.write_all(&buf).await.is_err() || w.flush().await.is_err() {
                break;
            }
        }
    }
}

fn push_frame(buf: &mut Vec<u8>, m: &NetMsg) {
    // Encoding a NetMsg cannot fail.
    buf.extend_from_slice(&wire::encode_frame(m).expect("a NetMsg always encodes"));
}

async fn serve_conn(
    sock: TcpStream,
    secret: Arc<Vec<u8>>,
    members: Arc<Vec<NodeId>>,
    peer_in: mpsc::Sender<(NodeId, PeerMsg)>,
    client_in: mpsc::Sender<(mpsc::Sender<NetMsg>, u64, ClientReq)>,
) {
    let mut sock = match wire::link::accept_authenticated(sock, &secret).await {
        Ok(s) => s,
        Err(e) => return tracing::warn!("refused connection: {e}"),
    };
    let Ok(NetMsg::Hello(hello)) = wire::read_msg::<NetMsg, _>(&mut sock, MAX_FRAME_BYTES).await else {
        return;
    };
    let (r, mut w) = sock.into_split();
    let mut r = tokio::io::BufReader::with_capacity(64 << 10, r);
    match hello {
        Hello::Peer(from) => {
            if !members.contains(&from) {
                return tracing::warn!("refused a peer connection from unknown node {from}");
            }
            while let Ok(NetMsg::Peer(m)) = wire::read_msg::<NetMsg, _>(&mut r, MAX_FRAME_BYTES).await {
                if peer_in.send((from, m)).await.is_err() {
                    return;
                }
            }
        }
        Hello::Client => {
            let (out_tx, mut out_rx) = mpsc::channel::<NetMsg>(CLIENT_INFLIGHT_MAX);
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                let mut buf = Vec::new();
                while let Some(m) = out_rx.recv().await {
                    buf.clear();
                    push_frame(&mut buf, &m);
                    while let Ok(m) = out_rx.try_recv() {
                        push_frame(&mut buf, &m);
                    }
                    if w.write_all(&buf).await.is_err() || w.flush().await.is_err() {
                        return;
                    }
                }
            });
            loop {
                // Bad input closes this connection only (a clear error was logged).
                let m = match wire::read_msg::<NetMsg, _>(&mut r, crate::witness::proto::MAX_CLIENT_MSG_BYTES + 1024).await {
                    Ok(m) => m,
                    Err(wire::WireError::Closed) => return,
                    Err(e) => return tracing::debug!("client connection closed: {e}"),
                };
                let NetMsg::Req { id, req } = m else { return };
                if client_in.send((out_tx.clone(), id, req)).await.is_err() {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::witness::proto::Op;

    fn put(index: u64, term: u64) -> Entry {
        Entry {
            index,
            term,
            op: Op::Put {
                key: format!("k{index}").into_bytes(),
                value: Some(serde_bytes::ByteBuf::from(vec![index as u8; 100])),
            },
        }
    }

    fn rec(r: &PmemRecord) -> Vec<u8> {
        postcard::to_allocvec(r).unwrap()
    }

    /// What the core asked for (appends, a Raft truncation, a free after writeback) is what a
    /// reopened node is given back: the newest term/vote and the live entries in index order.
    #[test]
    fn pmem_replay_applies_truncation_and_free() {
        let dir = tempfile::tempdir_in(PmemRegion::shm_dir()).unwrap();
        let cap = 4 << 20;
        {
            let (mut pm, d) = Pmem::open(dir.path(), cap).unwrap();
            assert!(d.meta.is_none() && d.entries.is_empty());
            pm.append(Region::Meta, &rec(&PmemRecord::Meta { term: 1, voted_for: None })).unwrap();
            for i in 1..=6 {
                pm.append(Region::Buffer, &rec(&PmemRecord::Entry(put(i, 1)))).unwrap();
            }
            // A new leader's log conflicts from index 5: 5 and 6 are replaced in term 2.
            pm.append(Region::Meta, &rec(&PmemRecord::Meta { term: 2, voted_for: Some(3) })).unwrap();
            pm.truncate(5).unwrap();
            pm.append(Region::Buffer, &rec(&PmemRecord::Entry(put(5, 2)))).unwrap();
            // Written back through index 3.
            pm.free(3).unwrap();
            assert_eq!(pm.live.iter().map(|(_, i)| *i).collect::<Vec<_>>(), vec![4, 5]);
        }
        let (pm, d) = Pmem::open(dir.path(), cap).unwrap();
        assert_eq!(d.meta, Some((2, Some(3))));
        assert_eq!(d.entries, vec![put(4, 1), put(5, 2)]);
        assert_eq!(pm.meta.len(), 1, "old term/vote records are freed");
        // Appends after a reopen go on with fresh ring seqs.
        let mut pm = pm;
        pm.append(Region::Buffer, &rec(&PmemRecord::Entry(put(6, 2)))).unwrap();
    }

    /// The core's SSD outputs through the real pool: a write creates its segment and reads
    /// back, a read of a freed segment comes back as an error input (never a hang), a data
    /// directory in memory is refused.
    #[test]
    fn ssd_outputs_round_trip_through_the_pool_and_tmpfs_is_refused() {
        use crate::witness::core::node::SsdLog;
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let (logs, segs) = open_ssd(dir.path()).unwrap();
        assert!(segs.is_empty());
        let (sub, done, pool) = IoPool::spawn(Arc::new(logs), IoConfig::default());
        let mut b = crate::witness::core::page::BatchBuilder::new(3, 0);
        let loc = b.push(&put(7, 1)).unwrap();
        let bytes = b.finish().0;
        let run = |o: Output| {
            sub.submit(io_request(o).unwrap()).unwrap();
            io_input(done.recv_timeout(Duration::from_secs(30)).unwrap())
        };
        let w = Output::SsdWrite { id: 5, seg: 3, log: SsdLog::Cold, off: 0, bytes: bytes.clone(), class: IoClass::Writeback };
        assert_eq!(run(w), Some(Input::SsdWritten { id: 5, result: Ok(()) }));
        assert!(dir.path().join(format!("cold-{:016}.seg", 3)).exists());
        let (off, len) = loc.page_span();
        let r = Output::SsdRead { id: 6, seg: 3, off, len: len as u32, class: IoClass::PriorityPull };
        let Some(Input::SsdRead { id: 6, result: Ok(got) }) = run(r.clone()) else { panic!() };
        assert_eq!(crate::witness::core::page::entry_at(loc, &got), Some(put(7, 1)));
        assert_eq!(run(Output::SsdFree { seg: 3 }), None);
        assert!(!dir.path().join(format!("cold-{:016}.seg", 3)).exists());
        assert!(matches!(run(r), Some(Input::SsdRead { id: 6, result: Err(_) })));
        drop(sub);
        pool.join();
        // The segment is found again at a restart only while it exists.
        let (_, segs) = open_ssd(dir.path()).unwrap();
        assert!(segs.is_empty());
        let shm = tempfile::tempdir_in(PmemRegion::shm_dir()).unwrap();
        assert!(matches!(open_ssd(shm.path()), Err(WitnessError::Config(_))));
    }
}
