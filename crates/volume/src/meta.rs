//! The metadata service: volumes, the cluster map, shard liveness, and the orchestration of
//! `super`, `collapse` and garbage collection.
//!
//! The decisions about volumes, `super`, `collapse` and jobs are made by the deterministic
//! [`MetaCore`](crate::meta_core::MetaCore); this module is its tokio driver (sockets, the state
//! file, the clock) and keeps the shard links and the failure detector, which change the map
//! through the core.
//!
//! Its state lives behind [`MetaStore`]; the embedded default, [`FileMetaStore`], keeps it in one
//! JSON file replaced atomically (write, fsync, rename, fsync the directory), so a restart loses
//! nothing. A later store can keep the same state in etcd.
//!
//! Shards open a control link to this service and register; the service pings them, marks one
//! down after `down_after_ms` without an answer or at once when its link ends (a killed shard's
//! kernel closes it), marks a restarted shard recovering, and marks it
//! up once it reports that re-replication finished. Every change bumps the map's epoch and is
//! pushed to every shard.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::net::{TcpListener, TcpStream};
use std::sync::Mutex;
use tokio::sync::{mpsc, oneshot};

use crate::meta_core::{CallId, MetaCore, MetaCoreConfig, MetaInput, MetaOutput};
use crate::shard_server::writer_loop;
use crate::types::*;

pub use crate::proto::{
    CollapseRec, Job, Layout, MetaReq, MetaResp, MetaState, VolumeRec, DEFAULT_OBJECT_SIZE_BYTES, MAX_COLLAPSE_RECORDS,
};

/// Where the metadata service keeps its state.
pub trait MetaStore: Send + Sync + 'static {
    fn load(&self) -> anyhow::Result<Option<MetaState>>;
    fn save(&self, state: &MetaState) -> anyhow::Result<()>;
}

pub struct FileMetaStore {
    path: PathBuf,
}

impl FileMetaStore {
    pub fn new(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create metadata directory {}", dir.display()))?;
        Ok(FileMetaStore { path: dir.join("meta.json") })
    }
}

impl MetaStore for FileMetaStore {
    fn load(&self) -> anyhow::Result<Option<MetaState>> {
        match std::fs::read(&self.path) {
            Ok(b) => Ok(Some(serde_json::from_slice(&b).with_context(|| format!("corrupt {}", self.path.display()))?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", self.path.display())),
        }
    }

    fn save(&self, state: &MetaState) -> anyhow::Result<()> {
        use std::io::Write;
        let tmp = self.path.with_extension("json.tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(state)?)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &self.path)?;
        std::fs::File::open(self.path.parent().unwrap())?.sync_all()?;
        Ok(())
    }
}

#[derive(Clone, Debug)]
pub struct MetaOptions {
    pub listen: SocketAddr,
    pub dir: PathBuf,
    pub replicas: u32,
    pub secret: Vec<u8>,
    pub ping_interval_ms: u64,
    pub down_after_ms: u64,
    /// Where to serve Prometheus metrics, if anywhere.
    pub metrics: Option<SocketAddr>,
}

struct ShardLink {
    tx: mpsc::Sender<Msg>,
    boot_id: u64,
    last_seen: Instant,
}

struct Inner {
    core: MetaCore,
    store: Box<dyn MetaStore>,
    links: HashMap<ShardId, ShardLink>,
    /// Control requests waiting for the core's reply.
    calls: HashMap<CallId, oneshot::Sender<MetaResp>>,
    next_call: CallId,
    /// The map epoch last pushed to the shards.
    pushed_epoch: Epoch,
}

/// Shared handle of the running service: the driver of [`MetaCore`].
#[derive(Clone)]
pub struct Meta {
    inner: Arc<Mutex<Inner>>,
    next_ping: Arc<std::sync::atomic::AtomicU64>,
    opts: Arc<MetaOptions>,
    started: Instant,
}

/// Request ids of liveness pings: a range of their own, apart from the core's requests.
const PING_REQ_BASE: u64 = 1 << 62;
/// How often the core's clock ticks (resends, retries, deadlines).
const META_TICK_MS: u64 = 20;

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

pub async fn run_meta(opts: MetaOptions) -> anyhow::Result<()> {
    let listener = TcpListener::bind(opts.listen).await.with_context(|| format!("cannot listen on {}", opts.listen))?;
    serve_meta(listener, opts).await
}

/// Runs the metadata service on a bound listener (`opts.listen` is ignored).
pub async fn serve_meta(listener: TcpListener, opts: MetaOptions) -> anyhow::Result<()> {
    let store = FileMetaStore::new(&opts.dir)?;
    let state = match store.load()? {
        Some(mut s) => {
            // After our own restart we do not know which shards live: none leads until it
            // registers again. Marked down here, not by the failure detector, so each keeps its
            // in-sync flag (a stale shard must not win a whole-cluster restart).
            let mut changed = false;
            for sh in s.map.shards.iter_mut().filter(|sh| sh.state != ShardState::Down) {
                sh.state = ShardState::Down;
                changed = true;
            }
            if changed {
                s.map.epoch += 1;
                store.save(&s)?;
            }
            s
        }
        None => {
            let s = MetaState::new(opts.replicas);
            store.save(&s)?;
            s
        }
    };
    let pushed_epoch = state.map.epoch;
    let core = MetaCore::new(MetaCoreConfig::default(), state, rand::random::<u64>() >> 20);
    let meta = Meta {
        inner: Arc::new(Mutex::new(Inner { core, store: Box::new(store), links: HashMap::new(), calls: HashMap::new(), next_call: 1, pushed_epoch })),
        next_ping: Arc::new(PING_REQ_BASE.into()),
        opts: Arc::new(opts),
        started: Instant::now(),
    };
    if let Some(addr) = meta.opts.metrics {
        let l = TcpListener::bind(addr).await.with_context(|| format!("cannot serve metrics on {addr}"))?;
        let m = meta.clone();
        tokio::spawn(wire::metrics::serve(l, move || {
            let m = m.clone();
            async move { m.render_metrics() }
        }));
    }
    tokio::spawn(meta.clone().liveness_loop());
    tokio::spawn(meta.clone().tick_loop());
    // Accept errors (out of descriptors) are waited out, never fatal: one client must not be
    // able to stop the metadata service.
    wire::listen::serve(listener, "metadata service", move |sock, _| {
        let m = meta.clone();
        async move {
            if let Err(e) = m.serve(sock).await {
                tracing::debug!("metadata connection: {e:#}");
            }
        }
    })
    .await;
    Ok(()) // not reached: the accept loop runs until the task is dropped
}

impl Inner {
    /// Feeds one input to the core and carries out its outputs: replies to their callers,
    /// messages to the shards' links, saves to the store (synchronously: a save is durable, or
    /// has failed, before the core hears of it and before anything after it goes out). Then
    /// pushes the durable map to every shard if its epoch moved.
    fn pump(&mut self, input: MetaInput) {
        let mut inputs = VecDeque::from([input]);
        while let Some(input) = inputs.pop_front() {
            for out in self.core.handle(input) {
                match out {
                    MetaOutput::Reply { call, resp } => {
                        if let Some(tx) = self.calls.remove(&call) {
                            let _ = tx.send(resp);
                        }
                    }
                    MetaOutput::Send { to, msg } => {
                        if let Some(l) = self.links.get(&to) {
                            let _ = l.tx.try_send(msg);
                        }
                    }
                    MetaOutput::Save { seq, state } => {
                        let result = self.store.save(&state).map_err(|e| format!("{e:#}"));
                        inputs.push_back(MetaInput::Saved { seq, result });
                    }
                }
            }
        }
        let map = &self.core.durable().map;
        if map.epoch != self.pushed_epoch {
            self.pushed_epoch = map.epoch;
            for l in self.links.values() {
                let _ = l.tx.try_send(Msg::Map(map.clone()));
            }
        }
    }

    /// Changes the cluster map through the core (saved, then pushed).
    fn change_map(&mut self, map: ClusterMap) {
        self.pump(MetaInput::SetMap(map));
    }

    /// Marks one shard down (and no longer in sync: writes go on without it), if it is not.
    fn mark_down(&mut self, id: ShardId, why: &str) {
        let mut map = self.core.durable().map.clone();
        if let Some(s) = map.shards.iter_mut().find(|s| s.id == id && s.state != ShardState::Down) {
            tracing::warn!(shard = id, "shard down: {why}");
            s.state = ShardState::Down;
            s.in_sync = false;
            map.epoch += 1;
            self.change_map(map);
        }
    }
}

impl Meta {
    fn render_metrics(&self) -> String {
        use wire::metrics::metric;
        let g = self.inner.lock().unwrap();
        let state = g.core.durable();
        let mut out = String::new();
        let map = &state.map;
        metric(&mut out, "understudy_meta_epoch", "gauge", "Cluster map epoch.", &[("", map.epoch as f64)]);
        let count = |st: ShardState| map.shards.iter().filter(|s| s.state == st).count() as f64;
        metric(
            &mut out,
            "understudy_meta_shards",
            "gauge",
            "Shards by state.",
            &[("state=\"up\"", count(ShardState::Up)), ("state=\"recovering\"", count(ShardState::Recovering)), ("state=\"down\"", count(ShardState::Down))],
        );
        metric(&mut out, "understudy_meta_volumes", "gauge", "Volumes.", &[("", state.volumes.len() as f64)]);
        metric(&mut out, "understudy_meta_jobs", "gauge", "Garbage collection and delete jobs pending.", &[("", state.jobs.len() as f64)]);
        out
    }

    /// One control request through the core; waits for its reply.
    async fn call(&self, req: MetaReq) -> MetaResp {
        let rx = {
            let mut g = self.inner.lock().unwrap();
            let call = g.next_call;
            g.next_call += 1;
            let (tx, rx) = oneshot::channel();
            g.calls.insert(call, tx);
            g.pump(MetaInput::Request { call, req });
            rx
        };
        rx.await.unwrap_or_else(|_| MetaResp::Err("the metadata service dropped the request".into()))
    }

    async fn tick_loop(self) {
        let mut iv = tokio::time::interval(Duration::from_millis(META_TICK_MS));
        loop {
            iv.tick().await;
            let now_us = self.started.elapsed().as_micros() as u64;
            self.inner.lock().unwrap().pump(MetaInput::Tick { now_us, unix_ms: now_unix_ms() });
        }
    }

    async fn serve(self, mut sock: TcpStream) -> anyhow::Result<()> {
        // Fails after wire::listen::AUTH_DEADLINE.
        wire::auth::accept(&mut sock, &self.opts.secret).await?;
        let hello: Hello = wire::read_msg(&mut sock, 1024).await?;
        match hello {
            Hello::Client => loop {
                let req: MetaReq = match wire::read_msg(&mut sock, wire::MAX_FRAME_PAYLOAD_BYTES).await {
                    Ok(r) => r,
                    Err(wire::WireError::Closed) => return Ok(()),
                    Err(e) => return Err(e.into()),
                };
                let resp = self.call(req).await;
                wire::write_msg(&mut sock, &resp).await?;
            },
            Hello::Shard(id) => self.shard_link(id, sock).await,
        }
    }

    async fn shard_link(self, id: ShardId, sock: TcpStream) -> anyhow::Result<()> {
        let (r, w) = sock.into_split();
        let mut r = tokio::io::BufReader::new(r);
        let first: Msg = wire::read_msg(&mut r, wire::MAX_FRAME_PAYLOAD_BYTES).await?;
        let Msg::Register { shard, addr, boot_id, fresh } = first else { anyhow::bail!("shard {id} did not register") };
        anyhow::ensure!(shard == id, "shard link says {id} but registers {shard}");
        let (tx, rx) = mpsc::channel(1024);
        tokio::spawn(writer_loop(w, rx));
        {
            let mut g = self.inner.lock().unwrap();
            let restarted = g.links.get(&id).is_none_or(|l| l.boot_id != boot_id);
            g.links.insert(id, ShardLink { tx: tx.clone(), boot_id, last_seen: Instant::now() });
            let mut map = g.core.durable().map.clone();
            let known = map.shards.iter().position(|s| s.id == id);
            let changed = match known {
                None => {
                    map.shards.push(ShardInfo { id, addr: addr.clone(), state: ShardState::Recovering, in_sync: false });
                    map.shards.sort_by_key(|s| s.id);
                    true
                }
                Some(i) => {
                    let s = &mut map.shards[i];
                    let mut changed = s.addr != addr;
                    s.addr = addr.clone();
                    if fresh && s.in_sync {
                        // A new disk under an old id holds nothing it used to.
                        s.in_sync = false;
                        changed = true;
                    }
                    // A restarted shard may have missed writes and lost unsynced ones: it
                    // re-replicates before it may lead again.
                    if restarted || s.state == ShardState::Down {
                        changed |= s.state != ShardState::Recovering;
                        s.state = ShardState::Recovering;
                    }
                    changed
                }
            };
            if changed {
                map.epoch += 1;
                tracing::info!(shard = id, epoch = map.epoch, "shard registered, recovering");
                g.change_map(map);
            }
            let map = g.core.durable().map.clone();
            let _ = tx.try_send(Msg::Map(map));
            // What the core sent over a link that broke is resent on this one at once.
            g.pump(MetaInput::LinkUp { shard: id });
        }
        loop {
            let msg: Msg = match wire::read_msg(&mut r, wire::MAX_FRAME_PAYLOAD_BYTES).await {
                Ok(m) => m,
                Err(e) => {
                    // The link ended: the shard's process died (its kernel closed the socket)
                    // or it dropped the link. Either way it is down now, not only once it has
                    // missed `down_after_ms` of pings: every write to one of its slots waits
                    // for the map to say so. (A shard that merely lost the link registers
                    // again within a moment and recovers, as a restarted one does.) A link
                    // already replaced by a newer registration changes nothing.
                    let mut g = self.inner.lock().unwrap();
                    if g.links.get(&id).is_some_and(|l| l.tx.same_channel(&tx)) {
                        g.links.remove(&id);
                        g.mark_down(id, &format!("its control link ended ({e})"));
                    }
                    return Ok(());
                }
            };
            match msg {
                Msg::Reply { req, result } => {
                    let mut g = self.inner.lock().unwrap();
                    if let Some(l) = g.links.get_mut(&id) {
                        l.last_seen = Instant::now();
                    }
                    if req < PING_REQ_BASE {
                        g.pump(MetaInput::ShardReply { from: id, req, result });
                    }
                }
                Msg::Recovered { shard, epoch } => {
                    let mut g = self.inner.lock().unwrap();
                    let mut map = g.core.durable().map.clone();
                    // A shard that missed writes may lead only once every in-sync shard is up:
                    // then each of its slots had an in-sync primary it caught up from. (It
                    // repeats its report; once the others are up, the new epoch restarts its
                    // recovery and the next report counts.)
                    let others_in_sync_up = map.shards.iter().filter(|s| s.id != shard && s.in_sync).all(|s| s.state == ShardState::Up);
                    if map.epoch == epoch {
                        if let Some(s) = map
                            .shards
                            .iter_mut()
                            .find(|s| s.id == shard && s.state == ShardState::Recovering && (s.in_sync || others_in_sync_up))
                        {
                            s.state = ShardState::Up;
                            s.in_sync = true;
                            map.epoch += 1;
                            tracing::info!(shard, epoch = map.epoch, "shard recovered, up");
                            g.change_map(map);
                        }
                    }
                }
                other => tracing::warn!("unexpected message from shard {id}: {other:?}"),
            }
        }
    }

    async fn liveness_loop(self) {
        let mut iv = tokio::time::interval(Duration::from_millis(self.opts.ping_interval_ms));
        loop {
            iv.tick().await;
            let mut g = self.inner.lock().unwrap();
            let now = Instant::now();
            let mut changed = false;
            let down_after = Duration::from_millis(self.opts.down_after_ms);
            let mut map = g.core.durable().map.clone();
            for s in map.shards.iter_mut() {
                let alive = g.links.get(&s.id).is_some_and(|l| now.duration_since(l.last_seen) < down_after);
                if !alive && s.state != ShardState::Down {
                    tracing::warn!(shard = s.id, "shard missed its pings: marking it down");
                    s.state = ShardState::Down;
                    s.in_sync = false;
                    changed = true;
                } else if alive && s.state == ShardState::Down {
                    // It answers again on the same link: it was stalled, not dead. It may have
                    // missed writes while down, so it re-replicates before it leads again
                    // (without this, Down was sticky until the shard process restarted).
                    tracing::warn!(shard = s.id, "shard answers its pings again: marking it recovering");
                    s.state = ShardState::Recovering;
                    changed = true;
                }
            }
            if changed {
                map.epoch += 1;
                g.change_map(map);
            }
            for l in g.links.values() {
                let req = self.next_ping.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let _ = l.tx.try_send(Msg::Ping { req });
            }
        }
    }
}

/// Checks a volume name (letters, digits, '-', '_', '.'; 1 to 128 characters).
pub fn validate_name(name: &str) -> anyhow::Result<()> {
    crate::meta_core::validate_name(name).map_err(anyhow::Error::msg)
}
