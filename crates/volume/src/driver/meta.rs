//! The metadata service: volumes, the cluster map, shard liveness, and the orchestration of
//! `super`, `collapse` and garbage collection.
//!
//! The decisions about volumes, `super`, `collapse` and jobs are made by the deterministic
//! [`MetaCore`](crate::core::meta::MetaCore), those about shard membership (down, recovering, up,
//! when a returning shard may lead) by the deterministic [`Membership`]; this module is their
//! tokio driver (sockets, the state file, the clock): it feeds the membership core the shards'
//! links, answers and reports, and hands its map changes to the metadata core to save.
//!
//! Its state lives behind [`MetaStore`]; the embedded default, [`FileMetaStore`], keeps it in one
//! JSON file replaced atomically (write, fsync, rename, fsync the directory), so a restart loses
//! nothing. A later store can keep the same state in etcd.
//!
//! Shards open a control link to this service and register; the service pings them, marks one
//! down after `down_after_ms` without an answer (counted only while the service runs) or at once
//! when its link ends (a killed shard's kernel closes it), marks a restarted shard recovering,
//! and marks it up once it reports that re-replication finished (see [`crate::core::membership`]).
//! Every change bumps the map's epoch and is pushed to every shard.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::net::{TcpListener, TcpStream};
use std::sync::Mutex;
use tokio::sync::{mpsc, oneshot};

use crate::core::membership::{LinkId, MemberInput, MemberOutput, Membership, MembershipConfig};
use crate::core::meta::{start_service, CallId, MetaCore, MetaCoreConfig, MetaInput, MetaOutput, ServiceStart};
use crate::driver::shard::writer_loop;
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
    /// This registration's number (the membership core's [`LinkId`]).
    link: LinkId,
}

struct Inner {
    core: MetaCore,
    members: Membership,
    next_link: LinkId,
    /// The next liveness ping's request id (from [`PING_REQ_BASE`] up).
    next_ping: u64,
    store: Box<dyn MetaStore>,
    links: HashMap<ShardId, ShardLink>,
    /// Control requests waiting for the core's reply.
    calls: HashMap<CallId, oneshot::Sender<MetaResp>>,
    next_call: CallId,
    /// The map epoch last pushed to the shards.
    pushed_epoch: Epoch,
    /// The cores' monotonic clock counts from here.
    started: Instant,
}

/// Shared handle of the running service: the driver of [`MetaCore`].
#[derive(Clone)]
pub struct Meta {
    inner: Arc<Mutex<Inner>>,
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
    let member_cfg = MembershipConfig { ping_interval_us: opts.ping_interval_ms * 1000, down_after_us: opts.down_after_ms * 1000 };
    let ServiceStart { save, core, members } =
        start_service(store.load()?, opts.replicas, MetaCoreConfig::default(), member_cfg, 0, rand::random::<u64>() >> 20);
    if let Some(s) = save {
        store.save(&s)?;
    }
    let pushed_epoch = core.durable().map.epoch;
    let inner = Inner {
        core,
        members,
        next_link: 1,
        next_ping: PING_REQ_BASE,
        store: Box::new(store),
        links: HashMap::new(),
        calls: HashMap::new(),
        next_call: 1,
        pushed_epoch,
        started: Instant::now(),
    };
    let started = inner.started;
    let meta = Meta { inner: Arc::new(Mutex::new(inner)), opts: Arc::new(opts), started };
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
            self.core.handle(self.started.elapsed().as_micros() as u64, input);
            for out in self.core.take_outputs() {
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

    /// Feeds one input to the membership core and carries out its outputs: a changed map goes
    /// to the metadata core (saved, then pushed), pings go out over the links.
    fn member(&mut self, now_us: u64, input: MemberInput) {
        self.members.handle(now_us, input);
        for out in self.members.take_outputs() {
            match out {
                MemberOutput::SetMap { map, why } => {
                    tracing::warn!(epoch = map.epoch, "cluster map: {why}");
                    self.pump(MetaInput::SetMap(map));
                }
                MemberOutput::Ping { shard } => {
                    let req = self.next_ping;
                    self.next_ping += 1;
                    if let Some(l) = self.links.get(&shard) {
                        let _ = l.tx.try_send(Msg::Ping { req });
                    }
                }
            }
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

    /// The driver's monotonic clock, µs.
    fn now_us(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
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
            self.inner.lock().unwrap().pump(MetaInput::Tick { unix_ms: now_unix_ms() });
        }
    }

    async fn serve(self, sock: TcpStream) -> anyhow::Result<()> {
        // TLS when this process's link setting asks for it for this peer; each step fails
        // after wire::listen::AUTH_DEADLINE.
        let mut sock = wire::link::accept(sock, wire::link::process()?).await?;
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
                // Over TLS the answer's last record may wait in the session until a flush.
                tokio::io::AsyncWriteExt::flush(&mut sock).await?;
            },
            Hello::Shard(id) => self.shard_link(id, sock).await,
        }
    }

    async fn shard_link(self, id: ShardId, sock: wire::link::Link) -> anyhow::Result<()> {
        let (r, w) = sock.into_split();
        let mut r = tokio::io::BufReader::new(r);
        let first: Msg = wire::read_msg(&mut r, wire::MAX_FRAME_PAYLOAD_BYTES).await?;
        let Msg::Register { shard, addr, boot_id, fresh } = first else { anyhow::bail!("shard {id} did not register") };
        anyhow::ensure!(shard == id, "shard link says {id} but registers {shard}");
        let (tx, rx) = mpsc::channel(1024);
        tokio::spawn(writer_loop(w, rx));
        let link = {
            let mut g = self.inner.lock().unwrap();
            let link = g.next_link;
            g.next_link += 1;
            g.links.insert(id, ShardLink { tx: tx.clone(), link });
            g.member(self.now_us(), MemberInput::LinkOpened { shard: id, link, addr: addr.clone(), boot_id, fresh });
            let map = g.core.durable().map.clone();
            let _ = tx.try_send(Msg::Map(map));
            // What the core sent over a link that broke is resent on this one at once.
            g.pump(MetaInput::LinkUp { shard: id });
            link
        };
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
                    if g.links.get(&id).is_some_and(|l| l.link == link) {
                        g.links.remove(&id);
                    }
                    g.member(self.now_us(), MemberInput::LinkClosed { shard: id, link, why: e.to_string() });
                    return Ok(());
                }
            };
            match msg {
                Msg::Reply { req, result } => {
                    let mut g = self.inner.lock().unwrap();
                    g.member(self.now_us(), MemberInput::Heard { shard: id });
                    if req < PING_REQ_BASE {
                        g.pump(MetaInput::ShardReply { from: id, req, result });
                    }
                }
                Msg::Recovered { shard, epoch } => {
                    self.inner.lock().unwrap().member(self.now_us(), MemberInput::Recovered { shard, epoch });
                }
                other => tracing::warn!("unexpected message from shard {id}: {other:?}"),
            }
        }
    }

    /// The membership core's clock: it checks silences and pings every shard at each tick.
    async fn liveness_loop(self) {
        let mut iv = tokio::time::interval(Duration::from_millis(self.opts.ping_interval_ms));
        loop {
            iv.tick().await;
            let mut g = self.inner.lock().unwrap();
            g.member(self.now_us(), MemberInput::Tick);
            // A map change whose save failed (the metadata core went back to its durable
            // state) is offered again.
            let map = g.members.map().clone();
            g.pump(MetaInput::SetMap(map));
        }
    }
}

/// Checks a volume name (letters, digits, '-', '_', '.'; 1 to 128 characters).
pub fn validate_name(name: &str) -> anyhow::Result<()> {
    crate::core::meta::validate_name(name).map_err(anyhow::Error::msg)
}
