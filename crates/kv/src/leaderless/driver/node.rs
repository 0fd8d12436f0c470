//! The node server: [`run_node`] runs a [`NodeCore`] over real sockets, a real log file and
//! the wall clock.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::events::{Event, EventLog, SinceStart};
use crate::leaderless::core::node::{NodeCore, NodeInput, NodeParams, Output, RecoveryStats};
use crate::leaderless::proto::*;
use crate::pmlog::{self, Append, FileLog};

use super::*;

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

pub(super) enum Input {
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

pub(super) fn add_us(c: &AtomicU64, since: Instant) {
    c.fetch_add(since.elapsed().as_micros() as u64, Ordering::Relaxed);
}

/// A heartbeat from the CM, the queue to answer it on, and when it arrived.
type HbInput = (Heartbeat, mpsc::Sender<NetMsg>, Instant);

/// Runs a node until the process is stopped.
pub async fn run_node(cfg: NodeConfig) -> Result<(), KvError> {
    std::fs::create_dir_all(&cfg.data_dir)?;
    let events = EventLog::open(cfg.events.as_deref())?;
    let (flog, st) = open_log(&cfg)?;
    let listener = TcpListener::bind(cfg.listen).await?;
    let (in_tx, mut in_rx) = mpsc::channel::<Input>(INPUT_QUEUE_MSGS);
    // Heartbeats have their own queue, served first: a busy node must neither look dead to the
    // CM (a false suspicion removes it, and its recovery adds load: the group can spiral into
    // reconfigurations) nor extend its read lease from a heartbeat that sat in a queue.
    let (hb_tx, mut hb_rx) = mpsc::channel::<HbInput>(64);
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
    let peer_tx = spawn_network(&cfg, listener, in_tx, hb_tx, &stats);

    let core = NodeCore::new(with_fresh_lease_refs(&cfg.params), st);
    // The rebuild's scaffolding is garbage now; from here on, freed chunk-sized buffers stay
    // in the process for the next ones (after the rebuild, whose large transient buffers
    // must go back to the OS).
    pmlog::release_free_memory();
    pmlog::keep_transient_buffers();
    let mut n = NodeLoop {
        cfg,
        core,
        inc: 0,
        start: Instant::now(),
        last_now: 0,
        replies: HashMap::new(),
        next_tag: 1,
        cm_tx: None,
        peer_tx,
        log_tx,
        stats,
        events,
    };
    // Timers are checked at this granularity (timeouts are tens of milliseconds).
    let mut tick = tokio::time::interval(Duration::from_millis(NODE_TICK_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        // A Buddy's catch-up stream sends one chunk per turn of this loop, between inputs, and
        // the loop does not wait for an input while the stream has chunks left.
        let pumping = n.core.wants_pump();
        let recovering = n.core.is_recovering();
        let waited = Instant::now();
        let idle = |stats: &NodeStats| {
            if recovering {
                add_us(&stats.recovering_idle_us, waited);
            }
        };
        tokio::select! {
            biased;
            Some((hb, tx, at)) = hb_rx.recv() => {
                idle(&n.stats);
                n.on_heartbeat(hb, tx, at);
            }
            _ = tick.tick() => {
                idle(&n.stats);
                n.last_now = n.now_us();
                n.core.handle(n.last_now, NodeInput::Tick);
            }
            Some(inp) = done_rx.recv() => {
                idle(&n.stats);
                n.on_log_done(inp, recovering);
            }
            Some(inp) = in_rx.recv() => {
                idle(&n.stats);
                n.on_input(inp);
            }
            _ = std::future::ready(()), if pumping => {}
        }
        n.pump();
        n.carry_out_outputs();
        n.publish_state();
    }
}

/// Opens the node's log and rebuilds its state (or, for the full-copy baseline's returning
/// node, starts it over as a new node).
fn open_log(cfg: &NodeConfig) -> Result<(FileLog, pmlog::LogState), KvError> {
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
    Ok((flog, st))
}

/// Starts the outbound connection to every peer (returning their queues) and the acceptor of
/// inbound connections (peers, the CM, clients).
fn spawn_network(
    cfg: &NodeConfig,
    listener: TcpListener,
    in_tx: mpsc::Sender<Input>,
    hb_tx: mpsc::Sender<HbInput>,
    stats: &Arc<NodeStats>,
) -> HashMap<NodeId, mpsc::Sender<PeerMsg>> {
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
    let secret = cfg.secret.clone();
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
    peer_tx
}

/// A running node's event loop state: its core, and where the core's outputs go.
struct NodeLoop {
    cfg: NodeConfig,
    core: NodeCore,
    /// Bumped at every `Reload`; log completions carry it.
    inc: u64,
    /// The core's clock starts here.
    start: Instant,
    /// The time of the last input given to the core (inputs never go back in time).
    last_now: u64,
    /// Client requests in the core, by tag: the connection to answer on and the request's id.
    replies: HashMap<u64, (mpsc::Sender<NetMsg>, u64)>,
    next_tag: u64,
    /// The CM's connection, from its last heartbeat.
    cm_tx: Option<mpsc::Sender<NetMsg>>,
    peer_tx: HashMap<NodeId, mpsc::Sender<PeerMsg>>,
    log_tx: std::sync::mpsc::Sender<LogJob>,
    stats: Arc<NodeStats>,
    events: EventLog,
}

impl NodeLoop {
    fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    /// The durable-append seqs of the current core (an older incarnation's are dropped).
    fn current_seqs(&self, seqs: Vec<(u64, u64)>) -> Vec<u64> {
        let inc = self.inc;
        seqs.into_iter()
            .filter(|(i, _)| *i == inc)
            .map(|(_, s)| s)
            .collect()
    }

    fn on_heartbeat(&mut self, hb: Heartbeat, tx: mpsc::Sender<NetMsg>, at: Instant) {
        // The lease counts from the heartbeat's arrival (never before an earlier input).
        let at_us =
            (at.saturating_duration_since(self.start).as_micros() as u64).max(self.last_now);
        self.last_now = at_us;
        self.cm_tx = Some(tx);
        self.core.handle(at_us, NodeInput::Heartbeat(hb));
    }

    /// A completion from the log thread.
    fn on_log_done(&mut self, inp: Input, recovering: bool) {
        let now = self.now_us();
        self.last_now = now;
        match inp {
            Input::Persisted(seqs) => {
                let t = Instant::now();
                let seqs = self.current_seqs(seqs);
                self.core.handle(now, NodeInput::Persisted(seqs));
                if recovering {
                    add_us(&self.stats.catchup_persisted_us, t);
                }
            }
            Input::LogRead { to, cursor, chunk } => self
                .core
                .handle(now, NodeInput::LogRead { to, cursor, chunk }),
            _ => {}
        }
    }

    /// An input from a connection (a peer's message, a client's request).
    fn on_input(&mut self, inp: Input) {
        let now = self.now_us();
        self.last_now = now;
        match inp {
            Input::Peer(from, m, decoded) => {
                // Timed phases of a catch-up (see `NodeStats`).
                let t = Instant::now();
                let stats = &self.stats;
                let phase = match &m {
                    PeerMsg::CatchUpResp { .. } => {
                        stats.catchup_queue_us.fetch_add(
                            t.saturating_duration_since(decoded).as_micros() as u64,
                            Ordering::Relaxed,
                        );
                        Some(&stats.catchup_apply_us)
                    }
                    PeerMsg::CatchUpReq { .. } => Some(&stats.catchup_build_us),
                    _ => None,
                };
                self.core.handle(now, NodeInput::Peer { from, msg: m });
                if let Some(p) = phase {
                    add_us(p, t);
                }
            }
            Input::Client { id, op, reply } => {
                let tag = self.next_tag;
                self.next_tag += 1;
                self.replies.insert(tag, (reply, id));
                self.core.handle(now, NodeInput::Client { tag, op });
            }
            Input::Persisted(seqs) => {
                let seqs = self.current_seqs(seqs);
                self.core.handle(now, NodeInput::Persisted(seqs));
            }
            Input::LogRead { to, cursor, chunk } => self
                .core
                .handle(now, NodeInput::LogRead { to, cursor, chunk }),
        }
    }

    /// One chunk of every credited catch-up stream (a Buddy's side).
    fn pump(&mut self) {
        if !self.core.wants_pump() {
            return;
        }
        self.last_now = self.now_us();
        let t = Instant::now();
        self.core.handle(self.last_now, NodeInput::Pump);
        let stats = &self.stats;
        add_us(&stats.catchup_build_us, t);
        if !self.core.serves_catchup() {
            // The Buddy's side of the catch-up (its last chunk is out), for the recovery's
            // breakdown.
            eprintln!(
                "catch-up served: node {} since start: chunks_sent {} build_us {} encode_us {} write_us {}",
                self.cfg.params.id,
                stats.catchup_chunks_sent.load(Ordering::Relaxed),
                stats.catchup_build_us.load(Ordering::Relaxed),
                stats.catchup_encode_us.load(Ordering::Relaxed),
                stats.catchup_write_us.load(Ordering::Relaxed)
            );
        }
    }

    /// Carries out the core's outputs in order; a Reload rebuilds the core and continues with
    /// its outputs.
    fn carry_out_outputs(&mut self) {
        loop {
            let outs = self.core.take_outputs();
            if outs.is_empty() {
                break;
            }
            // Consecutive appends go to the log thread as one job.
            let mut appends: Vec<(Option<(u64, u64)>, Append)> = Vec::new();
            let log_tx = self.log_tx.clone();
            let flush = |appends: &mut Vec<(Option<(u64, u64)>, Append)>| {
                if !appends.is_empty() {
                    let _ = log_tx.send(LogJob::Append(std::mem::take(appends)));
                }
            };
            for o in outs {
                let inc = self.inc;
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
                self.carry_out(o);
            }
            flush(&mut appends);
        }
    }

    /// One output other than a log append (those are batched by [`Self::carry_out_outputs`]).
    fn carry_out(&mut self, o: Output) {
        let me = self.cfg.params.id;
        match o {
            Output::Persist { .. } | Output::PersistChunk { .. } | Output::Mark(_) => {
                unreachable!("handled by carry_out_outputs")
            }
            Output::Send { to, msg } => {
                if let Some(tx) = self.peer_tx.get(&to) {
                    let _ = tx.try_send(msg);
                }
            }
            Output::ToCm(a) => {
                if let Some(tx) = &self.cm_tx {
                    let _ = tx.try_send(NetMsg::HbAck(a));
                }
            }
            Output::ReadLog {
                to,
                cursor,
                max_bytes,
            } => {
                let _ = self.log_tx.send(LogJob::Read {
                    to,
                    cursor,
                    max_bytes,
                });
            }
            Output::Reply { tag, result } => {
                if let Some((tx, id)) = self.replies.remove(&tag) {
                    let _ = tx.try_send(NetMsg::Resp { id, result });
                }
            }
            Output::Reload => {
                tracing::warn!(
                    node = me,
                    "removed from the configuration: reloading from the log to recover"
                );
                let (rtx, rrx) = std::sync::mpsc::channel();
                let as_new = self.cfg.params.returns_as_new_node(true).then_some(me);
                let _ = self.log_tx.send(LogJob::Rebuild(rtx, as_new));
                let st = tokio::task::block_in_place(|| rrx.recv()).unwrap_or_default();
                self.core = NodeCore::new(with_fresh_lease_refs(&self.cfg.params), st);
                pmlog::release_free_memory();
                self.inc += 1;
                // Durable completions of the old core are meaningless to the new one.
            }
            Output::Recovered(s) => self.report_recovery(s),
        }
    }

    /// A recovery completed: its breakdown to the log (for people), to the events file (for
    /// tools) and to the metrics.
    fn report_recovery(&mut self, s: RecoveryStats) {
        let me = self.cfg.params.id;
        let stats = &self.stats;
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
        self.events.append(Event::Recovered {
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

    /// The core's state, for the metrics; a changed configuration is logged.
    fn publish_state(&self) {
        let (core, stats) = (&self.core, &self.stats);
        if stats.epoch.load(Ordering::Relaxed) != core.epoch() {
            tracing::info!(
                node = self.cfg.params.id,
                epoch = core.epoch(),
                member = core.is_member_mode(),
                recovering = core.is_recovering(),
                serving = core.serving(self.now_us()),
                "configuration adopted"
            );
        }
        stats.epoch.store(core.epoch(), Ordering::Relaxed);
        stats
            .serving
            .store(core.serving(self.now_us()) as u64, Ordering::Relaxed);
        stats.keys.store(core.keys() as u64, Ordering::Relaxed);
        stats
            .missed_updates_bytes
            .store(core.missed_updates_bytes() as u64, Ordering::Relaxed);
    }
}

pub(super) fn render_node_metrics(s: &NodeStats) -> String {
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

/// `p` for a new core: its acks' lease refs start at the wall clock in microseconds, above every
/// ref an earlier core of this node issued (at most one per heartbeat, far fewer than one per
/// microsecond), so the CM's echo of an old core's ack anchors nothing in the new one.
pub(super) fn with_fresh_lease_refs(p: &NodeParams) -> NodeParams {
    let mut p = p.clone();
    p.first_lease_ref = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64);
    p
}

pub(super) async fn serve_conn(
    sock: TcpStream,
    secret: Vec<u8>,
    in_tx: mpsc::Sender<Input>,
    hb_tx: mpsc::Sender<(Heartbeat, mpsc::Sender<NetMsg>, Instant)>,
    stats: Arc<NodeStats>,
) {
    let mut sock = match wire::link::accept_authenticated(sock, &secret).await {
        Ok(s) => s,
        Err(e) => return tracing::warn!("refused connection: {e}"),
    };
    let Ok(NetMsg::Hello(hello)) = wire::read_msg::<NetMsg, _>(&mut sock, MAX_FRAME_BYTES).await
    else {
        return;
    };
    if matches!(hello, Hello::Peer(_)) {
        set_socket_buffer(sock.tcp(), libc::SO_RCVBUF, PEER_SOCKET_BUFFER_BYTES);
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
