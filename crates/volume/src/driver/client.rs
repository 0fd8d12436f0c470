//! The volume client: byte-addressed I/O over striped, replicated objects.
//!
//! A [`Cluster`] holds one multiplexed connection per shard (many requests in flight on each),
//! the cluster map, and a control connection to the metadata service. A [`Volume`] splits each
//! byte range into per-object requests sent to the objects' primaries concurrently; there is no
//! lock on the write path of plain volumes and collocated clones. A request that meets a stale
//! map, a failed primary or a timeout is retried at the new primary until `io_timeout`.
//!
//! The rbd-style general clone baseline lives here too: a general clone's client copies a parent
//! object up across the network and updates the clone's object map, under one lock per volume,
//! before the first write to each object — the behaviour the paper measured (§4.2, §6.2).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use blockdev::{BlockDev, DevError, DevResult};
use tokio::sync::{mpsc, oneshot, Mutex};

use crate::driver::meta::{Layout, MetaReq, MetaResp, VolumeRec};
use crate::driver::leader::{changed_from, order_addrs, Leader, LeaderWatch};
use crate::driver::shard::{dial, writer_loop, CONN_QUEUE_MSGS};
use crate::types::*;

/// How long a control request waits for the metadata service's answer. Generous (its requests
/// take milliseconds; a collapse asks one shard), but bounded: a service whose host died or was
/// cut off sends nothing, not even a reset, and the connection would otherwise wait for good
/// instead of moving on to the standby that took over.
pub const META_REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// A read-only control request's first wait on the kept connection, before it is asked again
/// on a fresh one: a read costs the service milliseconds, so this is long only for a loaded
/// machine's stalls, and short against a dead host's silence (issue 24: 10 s).
pub const META_READ_FIRST_REPLY_TIMEOUT: Duration = Duration::from_secs(2);
/// A kept connection that answered within this long is trusted with a request that changes
/// something; an older one is probed first (see [`Cluster::meta`]).
pub const META_FRESH_REPLY_WITHIN: Duration = Duration::from_millis(200);
/// How long the probe of a kept connection waits: past it the connection is replaced (a false
/// alarm on a stalled machine costs only a new connection).
pub const META_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How often one dial of the metadata service is started again because the election changed
/// during it; past this (an election flapping faster than a dial), the dial runs to its end.
pub const MAX_DIAL_RESTARTS: u32 = 8;
/// How long one request may wait for its reply before it is retried.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
/// A request without a reply for this long looks at the cluster map again (asking the
/// metadata service for a newer one), and goes to the new primary if its shard was marked
/// down meanwhile: a stopped shard then stalls writes no longer than its detection plus this.
pub const MAP_CHECK_INTERVAL: Duration = Duration::from_millis(250);
/// Object requests one client keeps in flight at most; a bigger I/O waits for room, so a huge
/// write cannot flood the shards (and their failure detector) with work.
pub const MAX_OBJECT_IOS_IN_FLIGHT: usize = 128;

type Waiter = oneshot::Sender<Result<ReplyBody, IoErr>>;

/// Requests of one connection waiting for their replies. `closed` is set, under the same lock,
/// when the connection's reader sees EOF or an error: from then on no request may wait on it
/// (nothing would ever answer it; it used to sit there until [`REQUEST_TIMEOUT`]).
#[derive(Default)]
struct Pending {
    waiters: HashMap<ReqId, Waiter>,
    closed: bool,
}

struct ShardConn {
    tx: mpsc::Sender<Msg>,
    pending: Arc<StdMutex<Pending>>,
}

impl ShardConn {
    /// A connection is dead as soon as its reader has seen it end, not only once a write to it
    /// fails: the write half of a socket whose peer died keeps accepting bytes until the
    /// peer's reset comes back, and a shard that died (or died and came back at the same
    /// address) answers nothing on it.
    fn is_closed(&self) -> bool {
        self.tx.is_closed() || self.pending.lock().unwrap().closed
    }

    /// Registers a waiter for `req`; `false` if the connection has already ended.
    fn wait_for(&self, req: ReqId, w: Waiter) -> bool {
        let mut p = self.pending.lock().unwrap();
        if p.closed {
            return false;
        }
        p.waiters.insert(req, w);
        true
    }

    fn forget(&self, req: ReqId) {
        self.pending.lock().unwrap().waiters.remove(&req);
    }
}

/// `addrs` (comma-separated) with `silent` moved to the end.
fn silent_last(addrs: &str, silent: Option<&str>) -> String {
    let (mut list, mut last): (Vec<&str>, Vec<&str>) =
        addrs.split(',').map(str::trim).filter(|a| !a.is_empty()).partition(|a| Some(*a) != silent);
    list.append(&mut last);
    list.join(",")
}

/// The kept connection to the metadata service.
struct MetaConn {
    link: wire::link::Link,
    /// The address it reached.
    addr: String,
    /// The leader (its election key) seen when it was dialled.
    leader: Option<Leader>,
    /// When it last answered (or was dialled): how long it may have been silent.
    last_reply: Instant,
}

pub struct Cluster {
    meta_addr: String,
    secret: Vec<u8>,
    map: RwLock<Arc<ClusterMap>>,
    conns: Mutex<HashMap<ShardId, Arc<ShardConn>>>,
    /// The connection to the metadata service, and the leader (its election key) seen when it
    /// was dialled.
    meta_conn: Mutex<Option<MetaConn>>,
    /// The address of the last metadata connection that went silent, dialled last.
    silent_meta_addr: StdMutex<Option<String>>,
    /// The metadata service's election, when followed ([`Cluster::connect_following`]).
    leader: Option<LeaderWatch>,
    /// One map fetch at a time: every request waiting on a silent shard looks at the map each
    /// [`MAP_CHECK_INTERVAL`], and up to [`MAX_OBJECT_IOS_IN_FLIGHT`] of them may wait at once;
    /// those that queue behind a fetch take its answer instead of asking again.
    map_fetch: Mutex<()>,
    /// Map fetches finished so far (tells a queued caller that one ended while it waited).
    map_fetches_done: AtomicU64,
    next_req: AtomicU64,
    in_flight: tokio::sync::Semaphore,
    /// Give up on an I/O after this long without success.
    pub io_timeout: Duration,
}

impl Cluster {
    pub async fn connect(meta_addr: &str, secret: &[u8]) -> anyhow::Result<Arc<Cluster>> {
        Self::connect_with(meta_addr, secret, None).await
    }

    /// [`Cluster::connect`], following the metadata service's leader in the control store
    /// (see [`crate::driver::leader`]): when the leader changes, a request waiting on the old
    /// one's connection (a paused leader answers nothing) is sent again to the new one.
    pub async fn connect_following(meta_addr: &str, secret: &[u8], leader: LeaderWatch) -> anyhow::Result<Arc<Cluster>> {
        Self::connect_with(meta_addr, secret, Some(leader)).await
    }

    async fn connect_with(meta_addr: &str, secret: &[u8], leader: Option<LeaderWatch>) -> anyhow::Result<Arc<Cluster>> {
        let c = Arc::new(Cluster {
            leader,
            meta_addr: meta_addr.to_string(),
            secret: secret.to_vec(),
            map: RwLock::new(Arc::new(ClusterMap { epoch: 0, replicas: 0, shards: vec![] })),
            conns: Mutex::new(HashMap::new()),
            meta_conn: Mutex::new(None),
            silent_meta_addr: StdMutex::new(None),
            map_fetch: Mutex::new(()),
            map_fetches_done: AtomicU64::new(0),
            next_req: AtomicU64::new(1),
            in_flight: tokio::sync::Semaphore::new(MAX_OBJECT_IOS_IN_FLIGHT),
            io_timeout: Duration::from_secs(30),
        });
        c.refresh_map(0).await?;
        Ok(c)
    }

    /// One control request to the metadata service.
    pub async fn meta(&self, req: MetaReq) -> anyhow::Result<MetaResp> {
        match self.meta_raw(&req).await? {
            MetaResp::Err(e) => anyhow::bail!(e),
            resp => Ok(resp),
        }
    }

    /// One request; reconnects once if the kept connection turns out broken. `Err` only for a
    /// transport failure (the service's own errors are `MetaResp::Err`).
    ///
    /// A service whose host died sends nothing, not even a reset, so a dead connection shows
    /// only as silence. A request that only reads (see [`MetaReq::is_read_only`]) waits
    /// [`META_READ_FIRST_REPLY_TIMEOUT`] on the kept connection, then is asked again on a fresh
    /// one. A request that changes something may have been acted on if its answer is lost, so
    /// it is never sent twice; instead, when the kept connection has not answered for
    /// [`META_FRESH_REPLY_WITHIN`], a map read probes it first (bounded by
    /// [`META_PROBE_TIMEOUT`]) and a silent one is replaced before the request goes out.
    async fn meta_raw(&self, req: &MetaReq) -> anyhow::Result<MetaResp> {
        let mut g = self.meta_conn.lock().await;
        let read_only = req.is_read_only();
        for attempt in 0..2 {
            let last = attempt == 1;
            if g.is_none() {
                *g = Some(self.dial_meta().await?);
            } else if !read_only && g.as_ref().unwrap().last_reply.elapsed() > META_FRESH_REPLY_WITHIN {
                match self.exchange(g.as_mut().unwrap(), &MetaReq::GetMap, META_PROBE_TIMEOUT).await {
                    Ok(_) => {}
                    Err(e) => {
                        self.went_silent(g.take());
                        tracing::debug!("metadata connection failed its probe: {e:#}; reconnecting");
                        if last {
                            return Err(e);
                        }
                        continue;
                    }
                }
            }
            let timeout = if read_only && !last { META_READ_FIRST_REPLY_TIMEOUT } else { META_REPLY_TIMEOUT };
            match self.exchange(g.as_mut().unwrap(), req, timeout).await {
                Ok(resp) => return Ok(resp),
                Err(e) => {
                    // The next request dials the service list afresh.
                    let silent = e.is::<tokio::time::error::Elapsed>();
                    if silent {
                        self.went_silent(g.take());
                    }
                    *g = None;
                    if silent && !read_only {
                        // The service may have acted on the request: not sent again.
                        anyhow::bail!("no answer from the metadata service within {timeout:?} (stopped, or its host lost or cut off)");
                    }
                    if last {
                        return Err(e);
                    }
                    tracing::debug!("metadata connection: {e:#}; reconnecting");
                }
            }
        }
        unreachable!()
    }

    /// A new connection to the metadata service: the list dialled in turn, the followed leader
    /// first and a silent address last. When the election changes during the dial it is started
    /// again, the new leader first: each silent address (a dead host's) costs the whole
    /// [`crate::driver::shard::META_DIAL_TIMEOUT`], and going on through the list would keep the
    /// caller waiting on them while the new leader already serves.
    async fn dial_meta(&self) -> anyhow::Result<MetaConn> {
        let mut restarts = 0;
        loop {
            let at = self.leader.as_ref().and_then(|w| w.current());
            let silent = self.silent_meta_addr.lock().unwrap().clone();
            let addrs = silent_last(&order_addrs(&self.meta_addr, at.as_ref()), silent.as_deref());
            // The leader the store names (unless its connection is the one that went silent) is
            // dialled alone for a moment first, see `dial_new_leader`: a dial mostly follows an
            // election, and the new leader may not have bound its address yet.
            let alone = at.as_ref().map(|l| l.addr.clone()).filter(|a| silent.as_ref() != Some(a) && self.meta_addr.split(',').any(|x| x.trim() == a));
            let dial = async {
                if let Some(a) = &alone {
                    if let Some(link) = crate::driver::shard::dial_new_leader(a, &self.secret, &Hello::Client).await {
                        return Ok((link, a.clone()));
                    }
                }
                crate::driver::shard::dial_meta_at(&addrs, &self.secret, &Hello::Client).await
            };
            let dialled = match &self.leader {
                Some(w) if restarts < MAX_DIAL_RESTARTS => {
                    let mut rx = w.subscribe();
                    tokio::select! {
                        r = dial => Some(r),
                        l = changed_from(&mut rx, at.as_ref().map(|l| l.key.as_str())) => {
                            tracing::debug!("the metadata leader changed to {} while dialling: dialling it first", l.addr);
                            None
                        }
                    }
                }
                _ => Some(dial.await),
            };
            match dialled {
                Some(r) => {
                    let (link, addr) = r.with_context(|| format!("cannot reach the metadata service at {}", self.meta_addr))?;
                    return Ok(MetaConn { link, addr, leader: at, last_reply: Instant::now() });
                }
                None => restarts += 1,
            }
        }
    }

    /// Remembers the address of a connection that went silent: dialled last next time (a dead
    /// host's address costs a whole [`crate::driver::shard::META_DIAL_TIMEOUT`] to try).
    fn went_silent(&self, conn: Option<MetaConn>) {
        if let Some(c) = conn {
            *self.silent_meta_addr.lock().unwrap() = Some(c.addr);
        }
    }

    /// One request and its reply on `conn`, within `timeout` (an `Elapsed` error when silent),
    /// or cut short when the followed leader changes.
    async fn exchange(&self, conn: &mut MetaConn, req: &MetaReq, timeout: Duration) -> anyhow::Result<MetaResp> {
        let MetaConn { link: sock, leader: at, last_reply, .. } = conn;
        let exchange = async {
            wire::write_msg(sock, req).await?;
            tokio::io::AsyncWriteExt::flush(sock).await?;
            Ok::<_, anyhow::Error>(wire::read_msg::<MetaResp, _>(sock, wire::MAX_FRAME_PAYLOAD_BYTES).await?)
        };
        let r = match &self.leader {
            None => tokio::time::timeout(timeout, exchange).await,
            Some(w) => {
                if at.is_none() {
                    // Dialled before the election was read: the leader seen first is the
                    // one the connection reached.
                    *at = w.current();
                }
                let mut rx = w.subscribe();
                let from = at.as_ref().map(|l| l.key.clone());
                tokio::select! {
                    r = tokio::time::timeout(timeout, exchange) => r,
                    l = changed_from(&mut rx, from.as_deref()) => Ok(Err(anyhow::anyhow!("the metadata leader changed to {}", l.addr))),
                }
            }
        };
        let resp = r??;
        *last_reply = Instant::now();
        Ok(resp)
    }

    /// `collapse CHILD`, seen through: a lost connection is made again and an undecided
    /// collapse asked again (collapse is idempotent: a repeated one answers the decided
    /// outcome), with growing waits, for up to `patience`.
    pub async fn collapse(&self, child: &str, patience: Duration) -> anyhow::Result<MetaResp> {
        let started = Instant::now();
        let mut wait = Duration::from_millis(100);
        let req = MetaReq::Collapse { child: child.to_string() };
        loop {
            let why = match self.meta_raw(&req).await {
                Ok(MetaResp::Err(e)) if e.contains("not decided yet") => e,
                Ok(MetaResp::Err(e)) => anyhow::bail!(e),
                Ok(resp) => return Ok(resp),
                Err(e) => format!("{e:#}"),
            };
            if started.elapsed() + wait > patience {
                anyhow::bail!("collapse of {child:?} not answered within {patience:?}: {why}");
            }
            tracing::warn!("collapse of {child:?}: {why}; asking again in {wait:?}");
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(2));
        }
    }

    /// Waits until the metadata service has no background job left (garbage collection after
    /// `collapse`, `abort` or `delete`), polling every 20 ms (cheap: one small request) for up to
    /// 120 s (the longest a benchmark's or test's collection has been seen to need, with room).
    pub async fn wait_for_jobs(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            match self.meta(MetaReq::Jobs).await? {
                MetaResp::Jobs(j) if j.is_empty() => return Ok(()),
                _ if Instant::now() > deadline => anyhow::bail!("garbage collection did not finish in 120 s"),
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    pub fn meta_addr(&self) -> &str {
        &self.meta_addr
    }

    pub fn map(&self) -> Arc<ClusterMap> {
        self.map.read().unwrap().clone()
    }

    /// Fetches the map unless one newer than `seen_epoch` is already here.
    pub async fn refresh_map(&self, seen_epoch: Epoch) -> anyhow::Result<()> {
        if self.map().epoch > seen_epoch {
            return Ok(());
        }
        let done_before = self.map_fetches_done.load(Ordering::Acquire);
        let _one_fetch = self.map_fetch.lock().await;
        if self.map_fetches_done.load(Ordering::Acquire) != done_before || self.map().epoch > seen_epoch {
            // A fetch ended while this caller queued: its map is as good as a second one, and
            // a caller that still finds it too old asks again on its next retry.
            return Ok(());
        }
        let fetched = self.meta(MetaReq::GetMap).await;
        self.map_fetches_done.fetch_add(1, Ordering::Release);
        if let MetaResp::Map(m) = fetched? {
            let mut g = self.map.write().unwrap();
            if m.epoch > g.epoch {
                *g = Arc::new(m);
            }
        }
        Ok(())
    }

    pub async fn volume_info(&self, name: &str) -> anyhow::Result<VolumeRec> {
        match self.meta(MetaReq::Info { name: name.to_string() }).await? {
            MetaResp::Volume(v) => Ok(v),
            other => anyhow::bail!("unexpected answer {other:?}"),
        }
    }

    pub async fn open(self: &Arc<Self>, name: &str) -> anyhow::Result<Volume> {
        let rec = self.volume_info(name).await?;
        Volume::new(self.clone(), rec).await
    }

    async fn conn(&self, shard: ShardId, addr: &str) -> anyhow::Result<Arc<ShardConn>> {
        let mut conns = self.conns.lock().await;
        if let Some(c) = conns.get(&shard) {
            if !c.is_closed() {
                return Ok(c.clone());
            }
        }
        let sock = dial(addr, &self.secret, &Hello::Client).await?;
        let (r, w) = sock.into_split();
        let (tx, rx) = mpsc::channel(CONN_QUEUE_MSGS);
        let pending: Arc<StdMutex<Pending>> = Default::default();
        let writer = tokio::spawn(writer_loop(w, rx));
        let p = pending.clone();
        tokio::spawn(async move {
            let mut r = tokio::io::BufReader::with_capacity(256 * 1024, r);
            while let Ok(Msg::Reply { req, result }) = wire::read_msg::<Msg, _>(&mut r, wire::MAX_FRAME_PAYLOAD_BYTES).await {
                if let Some(w) = p.lock().unwrap().waiters.remove(&req) {
                    let _ = w.send(result);
                }
            }
            // Connection gone (the shard died or closed it): everyone waiting retries at once,
            // and no later request waits on it; the writer stops, so the next request dials.
            writer.abort();
            let waiters = {
                let mut g = p.lock().unwrap();
                g.closed = true;
                std::mem::take(&mut g.waiters)
            };
            for (_, w) in waiters {
                let _ = w.send(Err(IoErr::NotReady));
            }
        });
        let c = Arc::new(ShardConn { tx, pending });
        conns.insert(shard, c.clone());
        Ok(c)
    }

    /// One I/O on one object, retried across failures until `io_timeout`.
    pub async fn io(&self, vol: &VolRef, objno: u64, op: IoOp) -> Result<ReplyBody, IoErr> {
        let _permit = self.in_flight.acquire().await.expect("the semaphore is never closed");
        let deadline = Instant::now() + self.io_timeout;
        let slot = Slot { table: vol.table, objno };
        let mut last_err = IoErr::NotReady;
        let mut backoff = Duration::from_millis(5);
        while Instant::now() < deadline {
            let map = self.map();
            let attempt = async {
                let p = map.primary(slot).ok_or(IoErr::NotReady)?;
                let conn = self.conn(p, map.addr(p).unwrap_or_default()).await.map_err(|_| IoErr::NotReady)?;
                let req = self.next_req.fetch_add(1, Ordering::Relaxed);
                let (wtx, wrx) = oneshot::channel();
                if !conn.wait_for(req, wtx) {
                    return Err(IoErr::NotReady);
                }
                let msg = Msg::Io { req, epoch: map.epoch, vol: vol.clone(), objno, op: op.clone() };
                if conn.tx.send(msg).await.is_err() {
                    conn.forget(req);
                    return Err(IoErr::NotReady);
                }
                let sent = Instant::now();
                let mut wrx = wrx;
                loop {
                    match tokio::time::timeout(MAP_CHECK_INTERVAL, &mut wrx).await {
                        Ok(Ok(r)) => return r,
                        // The connection's reader dropped the waiter without an answer.
                        Ok(Err(_)) => return Err(IoErr::NotReady),
                        Err(_) if sent.elapsed() >= REQUEST_TIMEOUT => {
                            conn.forget(req);
                            return Err(IoErr::NotReady);
                        }
                        Err(_) => {
                            // No answer yet: a shard that stopped (paused, cut off) answers
                            // nothing and its connection stays open, so only the map tells
                            // that it was marked down. Once it does, the request goes to the
                            // new primary now, not after the rest of REQUEST_TIMEOUT (were
                            // the stopped shard to run it still, its replicas, on the new
                            // epoch, refuse it: as after a timeout).
                            let _ = self.refresh_map(map.epoch).await;
                            let now = self.map();
                            if now.epoch > map.epoch && now.primary(slot) != Some(p) {
                                conn.forget(req);
                                return Err(IoErr::StaleEpoch(now.epoch));
                            }
                        }
                    }
                }
            };
            match attempt.await {
                Ok(body) => return Ok(body),
                Err(e) if e.is_retryable() => {
                    last_err = e;
                    // A newer map (the shard refused our epoch, or one of its shards changed
                    // state) is tried at once; only a retry that would go to the same place
                    // waits, with growing pauses (bounded), for the cluster to move on.
                    let _ = self.refresh_map(map.epoch).await;
                    if self.map().epoch == map.epoch {
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_millis(200));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(IoErr::Io(format!("gave up after {:?}: {last_err}", self.io_timeout)))
    }
}

/// One extent of a byte range within one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub objno: u64,
    pub offset_in_object: u32,
    pub len: u32,
    /// Offset of this extent within the caller's buffer.
    pub buf_offset: usize,
}

/// Splits `[offset, offset+len)` into per-object extents.
pub fn extents(object_size: u32, offset: u64, len: u64) -> Vec<Extent> {
    let mut out = vec![];
    let mut pos = offset;
    let end = offset + len;
    while pos < end {
        let objno = pos / object_size as u64;
        let off = (pos % object_size as u64) as u32;
        let n = ((object_size - off) as u64).min(end - pos) as u32;
        out.push(Extent { objno, offset_in_object: off, len: n, buf_offset: (pos - offset) as usize });
        pos += n as u64;
    }
    out
}

fn dev_err(e: IoErr) -> DevError {
    match e {
        IoErr::WriteRefused(m) => DevError::WriteRefused(m),
        IoErr::NoSpace(s) => DevError::NoSpace(format!("shard {s} is full")),
        IoErr::BadRequest(m) => DevError::OutOfRange(m),
        e => DevError::Io(e.to_string()),
    }
}

/// State of a general clone's client (the baseline).
struct GeneralState {
    parent: VolRef,
    object_map: Mutex<Vec<u8>>,
    /// One copy-up at a time per object, so two copy-ups never overwrite each other.
    copyups: StdMutex<HashMap<u64, Arc<Mutex<()>>>>,
}

/// An open volume; implements [`BlockDev`] for the NBD and FUSE fronts.
pub struct Volume {
    cluster: Arc<Cluster>,
    rec: VolumeRec,
    general: Option<GeneralState>,
}

impl Volume {
    pub async fn new(cluster: Arc<Cluster>, rec: VolumeRec) -> anyhow::Result<Volume> {
        let general = match &rec.layout {
            Layout::Plain => None,
            Layout::GeneralClone { parent } => {
                let objects = rec.size_bytes.div_ceil(rec.vol.object_size_bytes as u64);
                let map_bytes = objects.div_ceil(8);
                anyhow::ensure!(
                    map_bytes <= rec.vol.object_size_bytes as u64,
                    "general clone's object map of {map_bytes} bytes does not fit one object"
                );
                let body = cluster
                    .io(&rec.vol, OBJECT_MAP_OBJNO, IoOp::Read { offset: 0, len: map_bytes as u32 })
                    .await
                    .map_err(|e| anyhow::anyhow!("reading the object map: {e}"))?;
                let ReplyBody::Data(bits) = body else { anyhow::bail!("object map read returned {body:?}") };
                Some(GeneralState { parent: parent.clone(), object_map: Mutex::new(bits), copyups: Default::default() })
            }
        };
        Ok(Volume { cluster, rec, general })
    }

    pub fn record(&self) -> &VolumeRec {
        &self.rec
    }

    fn object_size(&self) -> u32 {
        self.rec.vol.object_size_bytes
    }

    async fn write_extent(&self, e: Extent, op: IoOp) -> Result<(), IoErr> {
        if let Some(g) = &self.general {
            return self.general_write(g, e, op).await;
        }
        self.cluster.io(&self.rec.vol, e.objno, op).await.map(|_| ())
    }

    async fn read_extent(&self, e: Extent) -> Result<Vec<u8>, IoErr> {
        let mut vol = &self.rec.vol;
        if let Some(g) = &self.general {
            let mapped = g.object_map.lock().await.get((e.objno / 8) as usize).is_some_and(|b| b & (1 << (e.objno % 8)) != 0);
            if !mapped {
                vol = &g.parent;
            }
        }
        match self.cluster.io(vol, e.objno, IoOp::Read { offset: e.offset_in_object, len: e.len }).await? {
            ReplyBody::Data(d) if d.len() == e.len as usize => Ok(d),
            other => Err(IoErr::Io(format!("short or odd read reply: {:?}", std::mem::discriminant(&other)))),
        }
    }

    /// The rbd-style path: copy the parent object up across the network, record it in the object
    /// map (serialised per volume), then write.
    async fn general_write(&self, g: &GeneralState, e: Extent, op: IoOp) -> Result<(), IoErr> {
        let bit = |m: &Vec<u8>| m.get((e.objno / 8) as usize).is_some_and(|b| b & (1 << (e.objno % 8)) != 0);
        if !bit(&*g.object_map.lock().await) {
            let lock = g.copyups.lock().unwrap().entry(e.objno).or_default().clone();
            let _copyup = lock.lock().await;
            if !bit(&*g.object_map.lock().await) {
                let osz = self.object_size();
                let ReplyBody::Data(mut data) =
                    self.cluster.io(&g.parent, e.objno, IoOp::Read { offset: 0, len: osz }).await?
                else {
                    return Err(IoErr::Io("copy-up read returned no data".into()));
                };
                let range = e.offset_in_object as usize..(e.offset_in_object + e.len) as usize;
                match &op {
                    IoOp::Write { data: d, .. } => data[range].copy_from_slice(d),
                    IoOp::Zero { .. } => data[range].fill(0),
                    IoOp::Read { .. } => unreachable!(),
                }
                // Object-map update: one durable write, serialised for the whole volume.
                let mut m = g.object_map.lock().await;
                let byte = (e.objno / 8) as usize;
                m[byte] |= 1 << (e.objno % 8);
                let b = m[byte];
                self.cluster.io(&self.rec.vol, OBJECT_MAP_OBJNO, IoOp::Write { offset: byte as u32, data: vec![b] }).await?;
                drop(m);
                return self.cluster.io(&self.rec.vol, e.objno, IoOp::Write { offset: 0, data }).await.map(|_| ());
            }
        }
        self.cluster.io(&self.rec.vol, e.objno, op).await.map(|_| ())
    }
}

impl BlockDev for Volume {
    fn size_bytes(&self) -> u64 {
        self.rec.size_bytes
    }

    async fn read(&self, offset: u64, len: u32) -> DevResult<Vec<u8>> {
        blockdev::check_range(self.size_bytes(), offset, len as u64)?;
        let parts = extents(self.object_size(), offset, len as u64);
        let results = futures::future::join_all(parts.iter().map(|e| self.read_extent(*e))).await;
        let mut buf = vec![0u8; len as usize];
        for (e, r) in parts.iter().zip(results) {
            let d = r.map_err(dev_err)?;
            buf[e.buf_offset..e.buf_offset + e.len as usize].copy_from_slice(&d);
        }
        Ok(buf)
    }

    async fn write(&self, offset: u64, data: Vec<u8>) -> DevResult<()> {
        blockdev::check_range(self.size_bytes(), offset, data.len() as u64)?;
        let parts = extents(self.object_size(), offset, data.len() as u64);
        let futs = parts.iter().map(|e| {
            let d = data[e.buf_offset..e.buf_offset + e.len as usize].to_vec();
            self.write_extent(*e, IoOp::Write { offset: e.offset_in_object, data: d })
        });
        for r in futures::future::join_all(futs).await {
            r.map_err(dev_err)?;
        }
        Ok(())
    }

    async fn flush(&self) -> DevResult<()> {
        // Every acknowledged write is already durable on all live replicas.
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u64) -> DevResult<()> {
        self.write_zeroes(offset, len).await
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> DevResult<()> {
        blockdev::check_range(self.size_bytes(), offset, len)?;
        let parts = extents(self.object_size(), offset, len);
        // Bound the fan-out of huge zeroing requests.
        for chunk in parts.chunks(64) {
            let futs = chunk.iter().map(|e| self.write_extent(*e, IoOp::Zero { offset: e.offset_in_object, len: e.len }));
            for r in futures::future::join_all(futs).await {
                r.map_err(dev_err)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_silent_address_is_dialled_last() {
        assert_eq!(silent_last("a:1, b:2,c:3", Some("a:1")), "b:2,c:3,a:1");
        assert_eq!(silent_last("a:1,b:2", Some("x:9")), "a:1,b:2");
        assert_eq!(silent_last("a:1,b:2", None), "a:1,b:2");
    }

    #[test]
    fn extents_cover_the_range_exactly() {
        let e = extents(65536, 65536 - 10, 20 + 65536);
        assert_eq!(e.len(), 3);
        assert_eq!(e[0], Extent { objno: 0, offset_in_object: 65526, len: 10, buf_offset: 0 });
        assert_eq!(e[1], Extent { objno: 1, offset_in_object: 0, len: 65536, buf_offset: 10 });
        assert_eq!(e[2], Extent { objno: 2, offset_in_object: 0, len: 10, buf_offset: 65546 });
        assert!(extents(4096, 100, 0).is_empty());
    }
}
