//! The metadata service: volumes, the cluster map, shard liveness, and the orchestration of
//! `super`, `collapse` and garbage collection.
//!
//! Its state lives behind [`MetaStore`]; the embedded default, [`FileMetaStore`], keeps it in one
//! JSON file replaced atomically (write, fsync, rename, fsync the directory), so a restart loses
//! nothing. A later store can keep the same state in etcd.
//!
//! Shards open a control link to this service and register; the service pings them, marks one
//! down after `down_after_ms` without an answer, marks a restarted shard recovering, and marks it
//! up once it reports that re-replication finished. Every change bumps the map's epoch and is
//! pushed to every shard.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, Mutex};

use crate::shard_server::writer_loop;
use crate::types::*;

pub const DEFAULT_OBJECT_SIZE_BYTES: u32 = 64 * 1024;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Layout {
    /// A plain volume, or a collocated `super` child (then `VolRef::parent` is set until GC ends).
    Plain,
    /// The rbd-style general clone baseline: own table, copy-up from the parent across the
    /// network, an object-map update per copied object.
    GeneralClone { parent: VolRef },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct VolumeRec {
    pub name: String,
    pub vol: VolRef,
    pub size_bytes: u64,
    pub layout: Layout,
    /// Name of this volume's `super` child while the superposition lasts.
    pub super_child: Option<String>,
    /// For a `super` child: its parent's name until collapse.
    pub super_parent: Option<String>,
    pub created_unix_ms: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Job {
    /// Garbage collection after collapse, then clearing the tracking object.
    Gc { table: TableId, parent: VolId, child: VolId, promoted: bool, child_name: Option<String> },
    /// Deleting a volume's objects.
    Delete { table: TableId, owner: VolId, drop_table: bool },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct MetaState {
    pub next_id: u64,
    pub map: ClusterMap,
    pub volumes: BTreeMap<String, VolumeRec>,
    pub jobs: Vec<Job>,
}

impl MetaState {
    pub fn new(replicas: u32) -> Self {
        MetaState { next_id: 1, map: ClusterMap { epoch: 1, replicas, shards: vec![] }, volumes: BTreeMap::new(), jobs: vec![] }
    }
}

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

/// Requests of control clients (the CLI, volume clients, the NBD server).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum MetaReq {
    GetMap,
    Create { name: String, size_bytes: u64, object_size_bytes: u32 },
    Delete { name: String },
    List,
    Info { name: String },
    Resize { name: String, size_bytes: u64 },
    /// Creates a collocated clone of `parent` named `child` and starts tracking parent writes.
    Super { parent: String, child: String },
    Collapse { child: String },
    /// Ends a superposition without promoting: the child is rejected and garbage-collected, the
    /// parent keeps (or gets back) permission to write. Answers the parent's record. An error
    /// for a volume that is not a super child, or whose collapse already promoted it.
    Abort { child: String },
    /// The rbd-style baseline clone.
    CloneGeneral { parent: String, child: String },
    /// Jobs (GC, deletes) still running.
    Jobs,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum MetaResp {
    Map(ClusterMap),
    Volume(VolumeRec),
    Volumes(Vec<VolumeRec>),
    Collapsed { outcome: CollapseOutcome, volume: Option<VolumeRec> },
    Jobs(Vec<Job>),
    Done,
    Err(String),
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
    state: MetaState,
    store: Box<dyn MetaStore>,
    links: HashMap<ShardId, ShardLink>,
}

/// Shared handle of the running service.
#[derive(Clone)]
pub struct Meta {
    inner: Arc<Mutex<Inner>>,
    /// Serialises control operations (super, collapse, create, delete): they are rare and
    /// simple to reason about one at a time.
    control: Arc<Mutex<()>>,
    pending: Arc<std::sync::Mutex<HashMap<ReqId, oneshot::Sender<Result<ReplyBody, IoErr>>>>>,
    next_req: Arc<std::sync::atomic::AtomicU64>,
    opts: Arc<MetaOptions>,
}

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
    let meta = Meta {
        inner: Arc::new(Mutex::new(Inner { state, store: Box::new(store), links: HashMap::new() })),
        control: Arc::new(Mutex::new(())),
        pending: Default::default(),
        next_req: Arc::new(1.into()),
        opts: Arc::new(opts),
    };
    if let Some(addr) = meta.opts.metrics {
        let l = TcpListener::bind(addr).await.with_context(|| format!("cannot serve metrics on {addr}"))?;
        let m = meta.clone();
        tokio::spawn(wire::metrics::serve(l, move || {
            let m = m.clone();
            async move { m.render_metrics().await }
        }));
    }
    tokio::spawn(meta.clone().liveness_loop());
    tokio::spawn(meta.clone().jobs_loop());
    loop {
        let (sock, _) = listener.accept().await?;
        let _ = sock.set_nodelay(true);
        let m = meta.clone();
        tokio::spawn(async move {
            if let Err(e) = m.serve(sock).await {
                tracing::debug!("metadata connection: {e:#}");
            }
        });
    }
}

impl Meta {
    async fn render_metrics(&self) -> String {
        use wire::metrics::metric;
        let g = self.inner.lock().await;
        let mut out = String::new();
        let map = &g.state.map;
        metric(&mut out, "understudy_meta_epoch", "gauge", "Cluster map epoch.", &[("", map.epoch as f64)]);
        let count = |st: ShardState| map.shards.iter().filter(|s| s.state == st).count() as f64;
        metric(
            &mut out,
            "understudy_meta_shards",
            "gauge",
            "Shards by state.",
            &[("state=\"up\"", count(ShardState::Up)), ("state=\"recovering\"", count(ShardState::Recovering)), ("state=\"down\"", count(ShardState::Down))],
        );
        metric(&mut out, "understudy_meta_volumes", "gauge", "Volumes.", &[("", g.state.volumes.len() as f64)]);
        metric(&mut out, "understudy_meta_jobs", "gauge", "Garbage collection and delete jobs pending.", &[("", g.state.jobs.len() as f64)]);
        out
    }

    async fn serve(self, mut sock: TcpStream) -> anyhow::Result<()> {
        tokio::time::timeout(Duration::from_secs(5), wire::auth::accept(&mut sock, &self.opts.secret)).await??;
        let hello: Hello = wire::read_msg(&mut sock, 1024).await?;
        match hello {
            Hello::Client => loop {
                let req: MetaReq = match wire::read_msg(&mut sock, wire::MAX_FRAME_PAYLOAD_BYTES).await {
                    Ok(r) => r,
                    Err(wire::WireError::Closed) => return Ok(()),
                    Err(e) => return Err(e.into()),
                };
                let resp = match self.handle(req).await {
                    Ok(r) => r,
                    Err(e) => MetaResp::Err(format!("{e:#}")),
                };
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
            let mut g = self.inner.lock().await;
            let restarted = g.links.get(&id).is_none_or(|l| l.boot_id != boot_id);
            g.links.insert(id, ShardLink { tx: tx.clone(), boot_id, last_seen: Instant::now() });
            let map = &mut g.state.map;
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
                g.state.map.epoch += 1;
                tracing::info!(shard = id, epoch = g.state.map.epoch, "shard registered, recovering");
                Self::persist(&mut g)?;
            }
            let map = g.state.map.clone();
            Self::push_map(&g, &map);
            let _ = tx.try_send(Msg::Map(map));
        }
        loop {
            let msg: Msg = match wire::read_msg(&mut r, wire::MAX_FRAME_PAYLOAD_BYTES).await {
                Ok(m) => m,
                Err(_) => return Ok(()),
            };
            match msg {
                Msg::Reply { req, result } => {
                    if let Some(l) = self.inner.lock().await.links.get_mut(&id) {
                        l.last_seen = Instant::now();
                    }
                    if let Some(w) = self.pending.lock().unwrap().remove(&req) {
                        let _ = w.send(result);
                    }
                }
                Msg::Recovered { shard, epoch } => {
                    let mut g = self.inner.lock().await;
                    // A shard that missed writes may lead only once every in-sync shard is up:
                    // then each of its slots had an in-sync primary it caught up from. (It
                    // repeats its report; once the others are up, the new epoch restarts its
                    // recovery and the next report counts.)
                    let others_in_sync_up =
                        g.state.map.shards.iter().filter(|s| s.id != shard && s.in_sync).all(|s| s.state == ShardState::Up);
                    if g.state.map.epoch == epoch {
                        if let Some(s) = g
                            .state
                            .map
                            .shards
                            .iter_mut()
                            .find(|s| s.id == shard && s.state == ShardState::Recovering && (s.in_sync || others_in_sync_up))
                        {
                            s.state = ShardState::Up;
                            s.in_sync = true;
                            g.state.map.epoch += 1;
                            tracing::info!(shard, epoch = g.state.map.epoch, "shard recovered, up");
                            Self::persist(&mut g)?;
                            let map = g.state.map.clone();
                            Self::push_map(&g, &map);
                        }
                    }
                }
                other => tracing::warn!("unexpected message from shard {id}: {other:?}"),
            }
        }
    }

    fn persist(g: &mut Inner) -> anyhow::Result<()> {
        g.store.save(&g.state)
    }

    fn push_map(g: &Inner, map: &ClusterMap) {
        for l in g.links.values() {
            let _ = l.tx.try_send(Msg::Map(map.clone()));
        }
    }

    async fn liveness_loop(self) {
        let mut iv = tokio::time::interval(Duration::from_millis(self.opts.ping_interval_ms));
        loop {
            iv.tick().await;
            let mut g = self.inner.lock().await;
            let now = Instant::now();
            let mut changed = false;
            let down_after = Duration::from_millis(self.opts.down_after_ms);
            let ids: Vec<ShardId> = g.state.map.shards.iter().map(|s| s.id).collect();
            for id in ids {
                let alive = g.links.get(&id).is_some_and(|l| now.duration_since(l.last_seen) < down_after);
                let s = g.state.map.shards.iter_mut().find(|s| s.id == id).unwrap();
                if !alive && s.state != ShardState::Down {
                    tracing::warn!(shard = id, "shard missed its pings: marking it down");
                    s.state = ShardState::Down;
                    s.in_sync = false;
                    changed = true;
                } else if alive && s.state == ShardState::Down {
                    // It answers again on the same link: it was stalled, not dead. It may have
                    // missed writes while down, so it re-replicates before it leads again
                    // (without this, Down was sticky until the shard process restarted).
                    tracing::warn!(shard = id, "shard answers its pings again: marking it recovering");
                    s.state = ShardState::Recovering;
                    changed = true;
                }
            }
            if changed {
                g.state.map.epoch += 1;
                if let Err(e) = Self::persist(&mut g) {
                    tracing::error!("cannot persist metadata: {e:#}");
                }
                let map = g.state.map.clone();
                Self::push_map(&g, &map);
            }
            for l in g.links.values() {
                let req = self.next_req.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let _ = l.tx.try_send(Msg::Ping { req });
            }
        }
    }

    /// Sends a request to one shard and waits for its reply.
    async fn ask(&self, shard: ShardId, make: impl Fn(ReqId, Epoch) -> Msg, timeout: Duration) -> Result<ReplyBody, IoErr> {
        let req = self.next_req.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (wtx, wrx) = oneshot::channel();
        self.pending.lock().unwrap().insert(req, wtx);
        {
            let g = self.inner.lock().await;
            let Some(l) = g.links.get(&shard) else {
                self.pending.lock().unwrap().remove(&req);
                return Err(IoErr::NotReady);
            };
            let _ = l.tx.try_send(make(req, g.state.map.epoch));
        }
        let r = tokio::time::timeout(timeout, wrx).await;
        self.pending.lock().unwrap().remove(&req);
        match r {
            Ok(Ok(result)) => result,
            _ => Err(IoErr::NotReady),
        }
    }

    /// Sends a request to the tracking shard of `table`, retrying across map changes.
    async fn ask_tracking(&self, table: TableId, make: impl Fn(ReqId, Epoch) -> Msg) -> anyhow::Result<ReplyBody> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let primary = self.inner.lock().await.state.map.primary(Slot { table, objno: TRACK_OBJNO });
            let r = match primary {
                Some(p) => self.ask(p, &make, Duration::from_secs(5)).await,
                None => Err(IoErr::NotReady),
            };
            match r {
                Ok(body) => return Ok(body),
                Err(e) if e.is_retryable() && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => anyhow::bail!("tracking shard: {e}"),
            }
        }
    }

    /// Sends a request to every shard not down and waits until all of them have acknowledged it
    /// at one epoch (shards refuse another epoch's), retrying across map changes: a shard that
    /// was down then learns the outcome from its peers when it re-replicates.
    async fn ask_all(&self, make: impl Fn(ReqId, Epoch) -> Msg) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (epoch, shards): (Epoch, Vec<ShardId>) = {
                let g = self.inner.lock().await;
                let live = g.state.map.shards.iter().filter(|s| s.state != ShardState::Down).map(|s| s.id).collect();
                (g.state.map.epoch, live)
            };
            let make = |req, _| make(req, epoch);
            let mut all_ok = true;
            let results = futures::future::join_all(shards.iter().map(|s| self.ask(*s, &make, Duration::from_secs(10)))).await;
            for (s, r) in shards.iter().zip(results) {
                if let Err(e) = r {
                    tracing::debug!("shard {s}: {e}");
                    all_ok = false;
                }
            }
            if all_ok && self.inner.lock().await.state.map.epoch == epoch {
                return Ok(());
            }
            if Instant::now() > deadline {
                anyhow::bail!("not every live shard answered");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn jobs_loop(self) {
        loop {
            let job = self.inner.lock().await.state.jobs.first().cloned();
            match job {
                None => tokio::time::sleep(Duration::from_millis(100)).await,
                Some(job) => match self.run_job(&job).await {
                    Ok(()) => {
                        let mut g = self.inner.lock().await;
                        g.state.jobs.retain(|j| j != &job);
                        if let Err(e) = Self::persist(&mut g) {
                            tracing::error!("cannot persist metadata: {e:#}");
                        }
                    }
                    Err(e) => {
                        tracing::warn!("job {job:?}: {e:#}; retrying");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                },
            }
        }
    }

    async fn run_job(&self, job: &Job) -> anyhow::Result<()> {
        match job.clone() {
            Job::Gc { table, parent, child, promoted, child_name } => {
                self.ask_all(|req, epoch| Msg::Gc { req, epoch, table, parent, child, promoted }).await?;
                self.ask_tracking(table, |req, epoch| Msg::EndSuper { req, epoch, table, child }).await?;
                // The child holds every object now: it no longer copies on write.
                let _c = self.control.lock().await;
                let mut g = self.inner.lock().await;
                if let Some(rec) = child_name.and_then(|n| g.state.volumes.get_mut(&n)) {
                    if rec.vol.id == child {
                        rec.vol.parent = None;
                    }
                }
                Self::persist(&mut g)
            }
            Job::Delete { table, owner, drop_table } => {
                self.ask_all(|req, epoch| Msg::DeleteVolume { req, epoch, table, owner, drop_table }).await
            }
        }
    }

    async fn update<T>(&self, f: impl FnOnce(&mut MetaState) -> anyhow::Result<T>) -> anyhow::Result<T> {
        let mut g = self.inner.lock().await;
        let mut next = g.state.clone();
        let out = f(&mut next)?;
        g.store.save(&next)?;
        g.state = next;
        Ok(out)
    }

    async fn handle(&self, req: MetaReq) -> anyhow::Result<MetaResp> {
        let get = |s: &MetaState, name: &str| -> anyhow::Result<VolumeRec> {
            s.volumes.get(name).cloned().ok_or_else(|| anyhow::anyhow!("no volume named {name:?} (see `understudy volume list`)"))
        };
        match req {
            MetaReq::GetMap => Ok(MetaResp::Map(self.inner.lock().await.state.map.clone())),
            MetaReq::List => Ok(MetaResp::Volumes(self.inner.lock().await.state.volumes.values().cloned().collect())),
            MetaReq::Info { name } => Ok(MetaResp::Volume(get(&self.inner.lock().await.state, &name)?)),
            MetaReq::Jobs => Ok(MetaResp::Jobs(self.inner.lock().await.state.jobs.clone())),
            MetaReq::Create { name, size_bytes, object_size_bytes } => {
                let _c = self.control.lock().await;
                validate_name(&name)?;
                anyhow::ensure!(
                    object_size_bytes.is_power_of_two() && (4096..=MAX_OBJECT_SIZE_BYTES).contains(&object_size_bytes),
                    "object size must be a power of two between 4 KiB and 4 MiB, not {object_size_bytes}"
                );
                anyhow::ensure!(size_bytes > 0 && size_bytes % 512 == 0, "size must be a positive multiple of 512 bytes");
                let rec = self
                    .update(|s| {
                        anyhow::ensure!(!s.volumes.contains_key(&name), "a volume named {name:?} already exists");
                        let id = s.next_id;
                        s.next_id += 1;
                        let rec = VolumeRec {
                            name: name.clone(),
                            vol: VolRef { id, table: id, object_size_bytes, parent: None },
                            size_bytes,
                            layout: Layout::Plain,
                            super_child: None,
                            super_parent: None,
                            created_unix_ms: now_unix_ms(),
                        };
                        s.volumes.insert(name.clone(), rec.clone());
                        Ok(rec)
                    })
                    .await?;
                Ok(MetaResp::Volume(rec))
            }
            MetaReq::Resize { name, size_bytes } => {
                let _c = self.control.lock().await;
                anyhow::ensure!(size_bytes > 0 && size_bytes % 512 == 0, "size must be a positive multiple of 512 bytes");
                let rec = self
                    .update(|s| {
                        let rec = s.volumes.get_mut(&name).ok_or_else(|| anyhow::anyhow!("no volume named {name:?}"))?;
                        anyhow::ensure!(size_bytes >= rec.size_bytes, "shrinking a volume is not supported (it would discard data)");
                        rec.size_bytes = size_bytes;
                        Ok(rec.clone())
                    })
                    .await?;
                Ok(MetaResp::Volume(rec))
            }
            MetaReq::Delete { name } => {
                let _c = self.control.lock().await;
                self.update(|s| {
                    let rec = get(s, &name)?;
                    anyhow::ensure!(rec.super_child.is_none(), "volume {name:?} has a super child; collapse it first");
                    anyhow::ensure!(rec.super_parent.is_none(), "volume {name:?} is a super child; collapse it instead");
                    anyhow::ensure!(
                        !s.volumes.values().any(|v| matches!(&v.layout, Layout::GeneralClone { parent } if parent.id == rec.vol.id)),
                        "volume {name:?} has general clones; delete them first"
                    );
                    anyhow::ensure!(rec.vol.parent.is_none(), "volume {name:?} is still being garbage-collected; retry shortly");
                    s.volumes.remove(&name);
                    let shares_table = s.volumes.values().any(|v| v.vol.table == rec.vol.table);
                    s.jobs.push(Job::Delete { table: rec.vol.table, owner: rec.vol.id, drop_table: !shares_table });
                    Ok(())
                })
                .await?;
                Ok(MetaResp::Done)
            }
            MetaReq::Super { parent, child } => {
                let _c = self.control.lock().await;
                validate_name(&child)?;
                let (p, child_id) = {
                    let g = self.inner.lock().await;
                    let p = get(&g.state, &parent)?;
                    anyhow::ensure!(!g.state.volumes.contains_key(&child), "a volume named {child:?} already exists");
                    anyhow::ensure!(p.super_child.is_none(), "volume {parent:?} already has a super child; collapse it first");
                    anyhow::ensure!(p.super_parent.is_none(), "volume {parent:?} is itself a super child; collapse it first");
                    anyhow::ensure!(p.vol.parent.is_none(), "volume {parent:?} is still being garbage-collected; retry shortly");
                    anyhow::ensure!(p.layout == Layout::Plain, "super needs a plain volume");
                    // A promoting collapse retires the parent and hands its objects to the child,
                    // which would leave a general clone reading through to a retired volume.
                    anyhow::ensure!(
                        !g.state.volumes.values().any(|v| matches!(&v.layout, Layout::GeneralClone { parent: gp } if gp.id == p.vol.id)),
                        "volume {parent:?} has general clones, which a promoting collapse would break; delete them first"
                    );
                    (p, g.state.next_id)
                };
                // Record the child first: if we crash before the tracking shard knows it, the
                // child is an orphan that collapse reports as "not a super child".
                let rec = self
                    .update(|s| {
                        s.next_id += 1;
                        let rec = VolumeRec {
                            name: child.clone(),
                            vol: VolRef { id: child_id, table: p.vol.table, object_size_bytes: p.vol.object_size_bytes, parent: Some(p.vol.id) },
                            size_bytes: p.size_bytes,
                            layout: Layout::Plain,
                            super_child: None,
                            super_parent: Some(parent.clone()),
                            created_unix_ms: now_unix_ms(),
                        };
                        s.volumes.insert(child.clone(), rec.clone());
                        s.volumes.get_mut(&parent).unwrap().super_child = Some(child.clone());
                        Ok(rec)
                    })
                    .await?;
                let table = p.vol.table;
                let parent_id = p.vol.id;
                let r = self
                    .ask_tracking(table, |req, epoch| Msg::Super { req, epoch, table, parent: parent_id, child: child_id })
                    .await;
                if let Err(e) = r {
                    // Undo: nothing tracks the child; the parent stays as it was.
                    self.update(|s| {
                        s.volumes.remove(&child);
                        if let Some(p) = s.volumes.get_mut(&parent) {
                            p.super_child = None;
                        }
                        Ok(())
                    })
                    .await?;
                    return Err(e.context("super failed"));
                }
                Ok(MetaResp::Volume(rec))
            }
            MetaReq::Collapse { child } => {
                let _c = self.control.lock().await;
                let c = get(&self.inner.lock().await.state, &child)?;
                let Some(parent_name) = c.super_parent.clone() else {
                    anyhow::bail!("volume {child:?} is not a super child: nothing to collapse");
                };
                let parent_id = c.vol.parent.expect("a super child has a parent");
                let (table, child_id) = (c.vol.table, c.vol.id);
                let body = self.ask_tracking(table, |req, epoch| Msg::Collapse { req, epoch, table, child: child_id }).await?;
                let ReplyBody::Collapse(outcome) = body else { anyhow::bail!("tracking shard answered {body:?}") };
                let promoted = outcome == CollapseOutcome::Promoted;
                let volume = self
                    .update(|s| {
                        s.jobs.push(Job::Gc { table, parent: parent_id, child: child_id, promoted, child_name: Some(child.clone()) });
                        if promoted {
                            // The parent is gone for good; the child is the volume now.
                            s.volumes.remove(&parent_name);
                            let rec = s.volumes.get_mut(&child).unwrap();
                            rec.super_parent = None;
                            Ok(Some(rec.clone()))
                        } else {
                            s.volumes.remove(&child);
                            if let Some(p) = s.volumes.get_mut(&parent_name) {
                                p.super_child = None;
                            }
                            Ok(None)
                        }
                    })
                    .await?;
                Ok(MetaResp::Collapsed { outcome, volume })
            }
            MetaReq::Abort { child } => {
                let _c = self.control.lock().await;
                let c = get(&self.inner.lock().await.state, &child)?;
                let Some(parent_name) = c.super_parent.clone() else {
                    // A promoted child lives on in its parent's table (a created volume has its own).
                    if c.vol.parent.is_some() || c.vol.table != c.vol.id {
                        anyhow::bail!("volume {child:?} was promoted by a collapse; a promoted child cannot be aborted");
                    }
                    anyhow::bail!("volume {child:?} is not a super child: nothing to abort");
                };
                let parent_id = c.vol.parent.expect("a super child has a parent");
                let (table, child_id) = (c.vol.table, c.vol.id);
                // The tracking object's own check-and-set decides: mark the superposition
                // written, as the parent's first write would (without writing anything), so the
                // collapse that follows must reject. A collapse that already promoted (this
                // service crashed before recording it) answers `Promoted` instead.
                match self.ask_tracking(table, |req, epoch| Msg::Permission { req, epoch, table, parent: parent_id }).await? {
                    ReplyBody::Granted(_) => {}
                    body => anyhow::bail!("tracking shard answered {body:?}"),
                }
                let body = self.ask_tracking(table, |req, epoch| Msg::Collapse { req, epoch, table, child: child_id }).await?;
                let ReplyBody::Collapse(outcome) = body else { anyhow::bail!("tracking shard answered {body:?}") };
                let promoted = outcome == CollapseOutcome::Promoted;
                let parent = self
                    .update(|s| {
                        s.jobs.push(Job::Gc { table, parent: parent_id, child: child_id, promoted, child_name: Some(child.clone()) });
                        if promoted {
                            s.volumes.remove(&parent_name);
                            s.volumes.get_mut(&child).unwrap().super_parent = None;
                            Ok(None)
                        } else {
                            s.volumes.remove(&child);
                            let p = s.volumes.get_mut(&parent_name);
                            Ok(p.map(|p| {
                                p.super_child = None;
                                p.clone()
                            }))
                        }
                    })
                    .await?;
                match parent {
                    Some(p) => Ok(MetaResp::Volume(p)),
                    None if promoted => anyhow::bail!("volume {child:?} was promoted by an earlier collapse; a promoted child cannot be aborted"),
                    None => anyhow::bail!("the parent {parent_name:?} of {child:?} is gone"),
                }
            }
            MetaReq::CloneGeneral { parent, child } => {
                let _c = self.control.lock().await;
                validate_name(&child)?;
                let rec = self
                    .update(|s| {
                        let p = get(s, &parent)?;
                        anyhow::ensure!(!s.volumes.contains_key(&child), "a volume named {child:?} already exists");
                        anyhow::ensure!(p.layout == Layout::Plain && p.vol.parent.is_none(), "general clones need a plain parent");
                        anyhow::ensure!(p.super_child.is_none(), "volume {parent:?} has a super child; collapse it first");
                        let id = s.next_id;
                        s.next_id += 1;
                        let rec = VolumeRec {
                            name: child.clone(),
                            vol: VolRef { id, table: id, object_size_bytes: p.vol.object_size_bytes, parent: None },
                            size_bytes: p.size_bytes,
                            layout: Layout::GeneralClone { parent: p.vol.clone() },
                            super_child: None,
                            super_parent: None,
                            created_unix_ms: now_unix_ms(),
                        };
                        s.volumes.insert(child.clone(), rec.clone());
                        Ok(rec)
                    })
                    .await?;
                Ok(MetaResp::Volume(rec))
            }
        }
    }
}

fn validate_name(name: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        !name.is_empty() && name.len() <= 128 && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)),
        "volume names are 1 to 128 characters of letters, digits, '-', '_' and '.', not {name:?}"
    );
    Ok(())
}
