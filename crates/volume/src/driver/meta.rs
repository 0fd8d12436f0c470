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
//! nothing. With [`MetaOptions::control`] (`volume meta --store URL`) it runs with standbys on
//! the control store instead: see [`ControlMetaStore`] and [`run_meta`].
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
    /// Run with standbys on the control store (None: alone, on `dir/meta.json`).
    pub control: Option<MetaControl>,
}

/// How the metadata service stands for leadership and where it keeps its state when it runs
/// with standbys (`volume meta --store URL`).
#[derive(Clone, Debug)]
pub struct MetaControl {
    /// The control store's address (`etcd://...`, or an embedded directory).
    pub store_url: String,
    /// The cluster name in the store's keys.
    pub cluster: String,
    /// The cluster's identity: a store holding another one is refused.
    pub cluster_id: String,
    /// The election lease: a leader that cannot renew it for this long stops serving; a
    /// standby takes over about this long after the leader died.
    pub election_ttl: Duration,
    /// What this service tells others when it leads (shown by `observe`).
    pub advertise: String,
    /// A metadata directory of a service that ran alone (its `meta.json`): imported by the
    /// first leader that finds no state in the store; ignored once the store holds one.
    pub import_from: Option<PathBuf>,
}

/// The election every metadata service of one volume cluster stands in.
pub const META_ELECTION: &str = "volume-meta";

/// The cluster id a metadata service derives from the cluster secret when none is given: two
/// clusters with different secrets never share one store's keys under one cluster name. A
/// checksum of the secret, not the secret: the store's readers need not know it.
pub fn cluster_id_from_secret(secret: &[u8]) -> String {
    control::daemon::cluster_id_from_secret("volume", secret)
}

/// Exit status of a metadata service that stopped leading: its tasks (shard links, client
/// connections, timers) end with the process, so nothing more is served or sent; a supervisor
/// restarts it as a standby.
pub const EXIT_NOT_LEADER: i32 = 75;

fn step_down(why: &str) -> ! {
    eprintln!("meta: no longer leading ({why}): exiting so that nothing more is served");
    tracing::error!("no longer leading ({why}): exiting");
    std::process::exit(EXIT_NOT_LEADER)
}

/// The state as keys of the control store, written only by the elected leader:
///
/// * `volume/state/gen`: the number of saves so far (decimal): the guard of every save;
/// * `volume/state/next_id`: the next volume id (decimal);
/// * `volume/state/map`: the cluster map (JSON; one entry per shard, small);
/// * `volume/vol/<name>`: one per volume (JSON [`VolumeRec`]);
/// * `volume/job/<seq>`: one per pending job (JSON [`Job`]);
/// * `volume/collapse/<seq>`: one per kept collapse record (JSON).
///
/// `<seq>` is a number given to a job or record when it is added and kept while it lives, so
/// finishing one job deletes one key (keyed by position, every later job's key moved and one
/// save of a long queue overflowed etcd's 128 operations per transaction). The core only
/// appends to both lists and removes from anywhere in them, so the order of the numbers is the
/// order of the lists; a new leader loads them by number.
///
/// A save writes only what changed since the last save, in one transaction guarded by the
/// generation it read or wrote last and by the leader's election key: a deposed leader's save
/// fails (`Deposed`) and it exits; a generation that moved under it (a writer outside the
/// election) also makes it exit rather than fork. Why a generation and not the map epoch: the
/// map epoch moves only with membership, while volumes, jobs and collapse records change
/// without it; one counter moved by every save guards them all.
pub struct ControlMetaStore {
    store: control::Store,
    lead: Arc<control::Leadership>,
    /// The store's own runtime (one worker thread): the driver calls [`MetaStore::save`] while
    /// it holds its state's lock, which every other task of the service's runtime may be
    /// waiting for; the store's requests must be driven by a thread that is never among them.
    rt: Option<tokio::runtime::Runtime>,
    /// What the store holds now (as of our last load or save).
    last: Mutex<Saved>,
}

/// The state the store holds, as of this service's last load or save.
#[derive(Clone, Debug, Default)]
struct Saved {
    gen: u64,
    state: Option<MetaState>,
    /// The key number of each job and collapse record of `state`, in its order.
    job_seqs: Vec<u64>,
    collapse_seqs: Vec<u64>,
    /// The next number to give (above every number in the store).
    next_seq: u64,
}

/// Key numbers for `new` given `old` and its numbers: an item of `old` that is still there
/// keeps its number (matched in order: the core only appends and removes), a new one gets the
/// next. The numbers come out increasing, so key order stays list order.
fn carry_seqs(old: &[Vec<u8>], old_seqs: &[u64], new: &[Vec<u8>], next_seq: &mut u64) -> Vec<u64> {
    let mut out = Vec::with_capacity(new.len());
    let mut i = 0;
    for n in new {
        while i < old.len() && old[i] != *n {
            i += 1; // removed
        }
        if i < old.len() {
            out.push(old_seqs[i]);
            i += 1;
        } else {
            out.push(*next_seq);
            *next_seq += 1;
        }
    }
    out
}

fn json_each<T: serde::Serialize>(items: &[T]) -> serde_json::Result<Vec<Vec<u8>>> {
    items.iter().map(serde_json::to_vec).collect()
}

fn seq_key(seq: u64) -> String {
    format!("{seq:016}")
}

/// The most operations one save's transaction may hold: etcd's default `--max-txn-ops` is 128.
pub const MAX_SAVE_OPS: usize = 128;

impl ControlMetaStore {
    pub fn new(store: control::Store, lead: Arc<control::Leadership>) -> anyhow::Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).thread_name("meta-store").enable_all().build()?;
        Ok(ControlMetaStore { store, lead, rt: Some(rt), last: Mutex::new(Saved::default()) })
    }

    fn k(&self, kind: &str, id: &str) -> String {
        self.store.key("volume", kind, id)
    }

    /// Every key of `st` with its value, jobs and collapse records under the numbers given.
    fn keys_of(&self, st: &MetaState, job_seqs: &[u64], collapse_seqs: &[u64]) -> anyhow::Result<std::collections::BTreeMap<String, Vec<u8>>> {
        let mut m = std::collections::BTreeMap::new();
        m.insert(self.k("state", "next_id"), st.next_id.to_string().into_bytes());
        m.insert(self.k("state", "map"), serde_json::to_vec(&st.map)?);
        for (name, v) in &st.volumes {
            m.insert(self.k("vol", name), serde_json::to_vec(v)?);
        }
        for (j, seq) in st.jobs.iter().zip(job_seqs) {
            m.insert(self.k("job", &seq_key(*seq)), serde_json::to_vec(j)?);
        }
        for (c, seq) in st.collapsed.iter().zip(collapse_seqs) {
            m.insert(self.k("collapse", &seq_key(*seq)), serde_json::to_vec(c)?);
        }
        Ok(m)
    }

    /// The jobs or collapse records under `kind`, by key number, with their numbers.
    async fn load_numbered<T: serde::de::DeserializeOwned>(&self, kind: &str) -> anyhow::Result<(Vec<T>, Vec<u64>)> {
        let bad = |why: String| anyhow::anyhow!("volume metadata in the control store: {why}");
        let mut items = Vec::new();
        for kv in self.store.list(&self.store.prefix("volume", kind)).await? {
            let seq: u64 = kv.key.rsplit('/').next().and_then(|n| n.parse().ok()).ok_or_else(|| bad(format!("{}: not a numbered key", kv.key)))?;
            let v: T = serde_json::from_slice(&kv.value).map_err(|e| bad(format!("{}: {e}", kv.key)))?;
            items.push((seq, v));
        }
        // By number, not by key text: stores written before the numbers were 16 digits wide
        // hold 8-digit keys.
        items.sort_by_key(|(seq, _)| *seq);
        Ok(items.into_iter().map(|(seq, v)| (v, seq)).unzip())
    }

    pub async fn load_async(&self) -> anyhow::Result<Option<MetaState>> {
        let bad = |why: String| anyhow::anyhow!("volume metadata in the control store: {why}");
        let Some(g) = self.store.get(&self.k("state", "gen")).await? else {
            *self.last.lock().unwrap() = Saved::default();
            return Ok(None);
        };
        let num = |v: &[u8], what: &str| -> anyhow::Result<u64> {
            std::str::from_utf8(v).ok().and_then(|s| s.parse().ok()).ok_or_else(|| bad(format!("{what} {:?} is not a number", String::from_utf8_lossy(v))))
        };
        let gen = num(&g.value, "gen")?;
        let next_id = num(&self.store.get(&self.k("state", "next_id")).await?.ok_or_else(|| bad("next_id missing".into()))?.value, "next_id")?;
        let map = serde_json::from_slice(&self.store.get(&self.k("state", "map")).await?.ok_or_else(|| bad("map missing".into()))?.value)?;
        let mut st = MetaState::with_map(map);
        st.next_id = next_id;
        for kv in self.store.list(&self.store.prefix("volume", "vol")).await? {
            let v: VolumeRec = serde_json::from_slice(&kv.value).map_err(|e| bad(format!("{}: {e}", kv.key)))?;
            st.volumes.insert(v.name.clone(), v);
        }
        let (jobs, job_seqs) = self.load_numbered("job").await?;
        let (collapsed, collapse_seqs) = self.load_numbered("collapse").await?;
        st.jobs = jobs;
        st.collapsed = collapsed;
        let next_seq = job_seqs.iter().chain(&collapse_seqs).max().map_or(0, |m| m + 1);
        *self.last.lock().unwrap() = Saved { gen, state: Some(st.clone()), job_seqs, collapse_seqs, next_seq };
        Ok(Some(st))
    }

    /// Writes a whole state into a store that holds none (an import of `meta.json`), in as
    /// many transactions as it takes, each guarded by the election and by the generation key
    /// still being absent; the generation key comes last, so until it is written the store
    /// reads as empty and an interrupted import is simply done again (keys left by one are
    /// deleted first).
    pub async fn import_async(&self, state: &MetaState) -> anyhow::Result<()> {
        use control::{Compare, Op};
        let gk = self.k("state", "gen");
        anyhow::ensure!(self.store.get(&gk).await?.is_none(), "the control store already holds volume metadata: nothing imported");
        let mut ops: Vec<Op> = Vec::new();
        for kind in ["vol", "job", "collapse"] {
            for kv in self.store.list(&self.store.prefix("volume", kind)).await? {
                ops.push(Op::delete(&kv.key));
            }
        }
        let job_seqs: Vec<u64> = (0..state.jobs.len() as u64).collect();
        let collapse_seqs: Vec<u64> = (0..state.collapsed.len() as u64).map(|i| i + job_seqs.len() as u64).collect();
        let next_seq = (job_seqs.len() + collapse_seqs.len()) as u64;
        for (k, v) in self.keys_of(state, &job_seqs, &collapse_seqs)? {
            ops.push(Op::put(&k, v));
        }
        for chunk in ops.chunks(MAX_SAVE_OPS) {
            match self.lead.txn(vec![Compare::absent(&gk)], chunk.to_vec()).await {
                Ok(out) if out.succeeded => {}
                Ok(_) => anyhow::bail!("another writer created the volume metadata during the import"),
                Err(e @ control::Error::Deposed { .. }) => step_down(&e.to_string()),
                Err(e) => return Err(e.into()),
            }
        }
        match self.lead.txn(vec![Compare::absent(&gk)], vec![Op::put(&gk, b"1".to_vec())]).await {
            Ok(out) if out.succeeded => {}
            Ok(_) => anyhow::bail!("another writer created the volume metadata during the import"),
            Err(e @ control::Error::Deposed { .. }) => step_down(&e.to_string()),
            Err(e) => return Err(e.into()),
        }
        *self.last.lock().unwrap() = Saved { gen: 1, state: Some(state.clone()), job_seqs, collapse_seqs, next_seq };
        Ok(())
    }

    pub async fn save_async(&self, state: &MetaState) -> anyhow::Result<()> {
        use control::{Compare, Op};
        let last = self.last.lock().unwrap().clone();
        let (gen, before) = (last.gen, &last.state);
        let old = match before {
            Some(b) => self.keys_of(b, &last.job_seqs, &last.collapse_seqs)?,
            None => Default::default(),
        };
        let (old_jobs, old_recs) = match before {
            Some(b) => (json_each(&b.jobs)?, json_each(&b.collapsed)?),
            None => Default::default(),
        };
        let mut next_seq = last.next_seq;
        let job_seqs = carry_seqs(&old_jobs, &last.job_seqs, &json_each(&state.jobs)?, &mut next_seq);
        let collapse_seqs = carry_seqs(&old_recs, &last.collapse_seqs, &json_each(&state.collapsed)?, &mut next_seq);
        let new = self.keys_of(state, &job_seqs, &collapse_seqs)?;
        let gk = self.k("state", "gen");
        let guard = if before.is_some() { Compare::value(&gk, gen.to_string().into_bytes()) } else { Compare::absent(&gk) };
        let mut ops = vec![Op::put(&gk, (gen + 1).to_string().into_bytes())];
        for (k, v) in &new {
            if old.get(k) != Some(v) {
                ops.push(Op::put(k, v.clone()));
            }
        }
        for k in old.keys() {
            if !new.contains_key(k) {
                ops.push(Op::delete(k));
            }
        }
        anyhow::ensure!(
            ops.len() <= MAX_SAVE_OPS,
            "one save would change {} keys, over the {MAX_SAVE_OPS} one etcd transaction may hold",
            ops.len()
        );
        match self.lead.txn(vec![guard], ops).await {
            Ok(out) if out.succeeded => {}
            Ok(_) => step_down(&format!("the state's generation in the control store is no longer {gen}: another writer outside the election")),
            Err(e @ control::Error::Deposed { .. }) => step_down(&e.to_string()),
            Err(e @ control::Error::Uncertain { .. }) => {
                // Only this leader writes: the generation says whether the write was applied.
                let now = self.store.get(&gk).await?.map(|kv| kv.value);
                if now != Some((gen + 1).to_string().into_bytes()) {
                    return Err(e.into());
                }
            }
            Err(e) => return Err(e.into()),
        }
        *self.last.lock().unwrap() = Saved { gen: gen + 1, state: Some(state.clone()), job_seqs, collapse_seqs, next_seq };
        Ok(())
    }
}

impl Drop for ControlMetaStore {
    fn drop(&mut self) {
        // Dropped from an async task when the service stops: a runtime may not be shut down
        // there by waiting, only in the background.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl MetaStore for ControlMetaStore {
    fn load(&self) -> anyhow::Result<Option<MetaState>> {
        // The driver calls its store synchronously (a save is durable before the core hears of
        // it); the store is async: wait for it on this thread (its other tasks move to another
        // worker), while the store's own runtime drives the requests.
        tokio::task::block_in_place(|| self.rt.as_ref().expect("runtime kept until drop").block_on(self.load_async()))
    }

    fn save(&self, state: &MetaState) -> anyhow::Result<()> {
        if !self.lead.is_leader() {
            step_down("election lease lost");
        }
        tokio::task::block_in_place(|| self.rt.as_ref().expect("runtime kept until drop").block_on(self.save_async(state)))
    }
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
    /// The leadership this service serves under (None: alone on its file).
    lead: Option<Arc<control::Leadership>>,
}

/// Shared handle of the running service: the driver of [`MetaCore`].
#[derive(Clone)]
pub struct Meta {
    inner: Arc<Mutex<Inner>>,
    opts: Arc<MetaOptions>,
    /// This service reads the shards' leases (it runs on etcd, where shards can register).
    reads_leases: bool,
    started: Instant,
}

/// Request ids of liveness pings: a range of their own, apart from the core's requests.
const PING_REQ_BASE: u64 = 1 << 62;
/// How often the core's clock ticks (resends, retries, deadlines).
const META_TICK_MS: u64 = 20;

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Runs the metadata service: alone on its state file, or, with [`MetaOptions::control`], as a
/// candidate that serves only while it leads.
///
/// A standby does not listen on its address at all: shards and clients given several addresses
/// (`--meta a,b`) try them in turn and reach only the leader, with no redirect protocol and no
/// chance of a standby answering from a stale state. The leader binds the address once elected,
/// loads the state the previous leader left (that one can no longer write: its election key is
/// gone), and serves; when its lease is lost it exits at once ([`EXIT_NOT_LEADER`]), which ends
/// every link and timer it had.
pub async fn run_meta(opts: MetaOptions) -> anyhow::Result<()> {
    let Some(ctl) = opts.control.clone() else {
        let listener = TcpListener::bind(opts.listen).await.with_context(|| format!("cannot listen on {}", opts.listen))?;
        return serve_meta(listener, opts).await;
    };
    let store = control::Store::open(&ctl.store_url, &ctl.cluster, &ctl.cluster_id).await?;
    let lead = Arc::new(
        control::daemon::campaign_until_leading(&store, META_ELECTION, &ctl.advertise, ctl.election_ttl, |lost| match lost {
            None => eprintln!("meta: standing for leadership of {META_ELECTION} as {}", ctl.advertise),
            // The store was out of reach long enough to lose the candidacy: stand again.
            Some(e) => eprintln!("meta: candidacy lost ({e}); standing again"),
        })
        .await?,
    );
    eprintln!("meta: leading {META_ELECTION} (fencing token {})", lead.fencing_token());
    // The old leader's process may still hold the port for a moment if it was merely deposed
    // (it exits as soon as it learns so): retry the bind for up to one election TTL.
    let deadline = Instant::now() + ctl.election_ttl.max(Duration::from_secs(1));
    let listener = loop {
        match TcpListener::bind(opts.listen).await {
            Ok(l) => break l,
            Err(e) if Instant::now() < deadline => {
                tracing::warn!("cannot listen on {} yet: {e}", opts.listen);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("cannot listen on {}", opts.listen)),
        }
    };
    let leases = LeaseReader { store: store.clone(), every: control::election::poll_interval(ctl.election_ttl) };
    let ms = ControlMetaStore::new(store, lead.clone())?;
    if let Some(dir) = &ctl.import_from {
        if ms.load_async().await?.is_none() {
            let file = FileMetaStore::new(dir)?;
            let st = file.load()?.ok_or_else(|| anyhow::anyhow!("--import-from {}: no meta.json there", dir.display()))?;
            ms.import_async(&st).await.with_context(|| format!("importing {}", file.path.display()))?;
            eprintln!("meta: imported {} volumes, {} jobs from {} into the control store", st.volumes.len(), st.jobs.len(), file.path.display());
        } else {
            eprintln!("meta: the control store already holds the volume metadata; --import-from {} ignored", dir.display());
        }
    }
    // On a worker thread: the store is called synchronously from there (block_in_place).
    let serving = tokio::spawn(serve_with(listener, opts, Box::new(ms), Some(lead.clone()), Some(leases)));
    tokio::select! {
        r = serving => r.context("the metadata service's task failed")?,
        why = lead.lost() => step_down(&why),
    }
}

/// Runs the metadata service on a bound listener (`opts.listen` is ignored).
pub async fn serve_meta(listener: TcpListener, opts: MetaOptions) -> anyhow::Result<()> {
    let store = FileMetaStore::new(&opts.dir)?;
    serve_with(listener, opts, Box::new(store), None, None).await
}

/// Reads the shards' liveness leases from the control store for the membership core.
struct LeaseReader {
    store: control::Store,
    /// How often (the election's poll interval: a tenth of its TTL, bounded).
    every: Duration,
}

async fn serve_with(
    listener: TcpListener,
    opts: MetaOptions,
    store: Box<dyn MetaStore>,
    lead: Option<Arc<control::Leadership>>,
    leases: Option<LeaseReader>,
) -> anyhow::Result<()> {
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
        store,
        links: HashMap::new(),
        calls: HashMap::new(),
        next_call: 1,
        pushed_epoch,
        started: Instant::now(),
        lead,
    };
    let started = inner.started;
    // Only etcd is shared by several processes: shards cannot register in an embedded store.
    let leases = leases.filter(|r| r.store.is_etcd());
    let meta = Meta { inner: Arc::new(Mutex::new(inner)), opts: Arc::new(opts), started, reads_leases: leases.is_some() };
    if let Some(addr) = meta.opts.metrics {
        let l = TcpListener::bind(addr).await.with_context(|| format!("cannot serve metrics on {addr}"))?;
        let m = meta.clone();
        tokio::spawn(wire::metrics::serve(l, move || {
            let m = m.clone();
            async move { m.render_metrics() }
        }));
    }
    tokio::spawn(meta.clone().liveness_loop());
    if let Some(r) = leases {
        tokio::spawn(meta.clone().lease_loop(r));
    }
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
                        let t = Instant::now();
                        let result = self.store.save(&state).map_err(|e| format!("{e:#}"));
                        tracing::debug!(seq, took_us = t.elapsed().as_micros() as u64, "metadata state saved");
                        if let Err(e) = &result {
                            tracing::warn!("saving the metadata state failed (offered again at the next change or tick): {e}");
                        }
                        inputs.push_back(MetaInput::Saved { seq, result });
                    }
                }
            }
        }
        let map = &self.core.durable().map;
        if map.epoch != self.pushed_epoch {
            tracing::debug!(epoch = map.epoch, shards = self.links.len(), "pushing the durable map");
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
            // A leader whose lease is gone (it was paused, or cut off from the store) answers
            // nothing more, not even a read: a new leader may have changed what it would say.
            if g.lead.as_ref().is_some_and(|l| !l.is_leader()) {
                step_down("election lease lost");
            }
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
        let mut sock = wire::link::accept_authenticated(sock, &self.opts.secret).await?;
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
        let Msg::Register { shard, addr, boot_id, fresh, leased } = first else { anyhow::bail!("shard {id} did not register") };
        anyhow::ensure!(shard == id, "shard link says {id} but registers {shard}");
        let leased = if leased && !self.reads_leases {
            // A shard given --store while this service runs without etcd: its lease would never
            // be read, and it would stay down. Its link alone tells its liveness here.
            tracing::warn!("shard {id} keeps a lease in a control store this metadata service does not read (run it with --store etcd://...): its link alone counts");
            false
        } else {
            leased
        };
        let (tx, rx) = mpsc::channel(1024);
        tokio::spawn(writer_loop(w, rx));
        let link = {
            let mut g = self.inner.lock().unwrap();
            let link = g.next_link;
            g.next_link += 1;
            g.links.insert(id, ShardLink { tx: tx.clone(), link });
            g.member(self.now_us(), MemberInput::LinkOpened { shard: id, link, addr: addr.clone(), boot_id, fresh, leased });
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

    /// Feeds the membership core the shards' live registrations (`live/shard/<id>` and their
    /// leases) as read from the store. A read that fails feeds nothing: a store out of reach
    /// says nothing about the shards (this service's own election lease decides whether it
    /// may go on at all).
    async fn lease_loop(self, r: LeaseReader) {
        let prefix = r.store.prefix("live", "shard");
        loop {
            match r.store.list(&prefix).await {
                Ok(kvs) => {
                    let live = kvs.iter().filter_map(|kv| kv.key[prefix.len()..].parse::<ShardId>().ok().map(|id| (id, kv.lease))).collect();
                    self.inner.lock().unwrap().member(self.now_us(), MemberInput::Leases { live });
                }
                Err(e) => tracing::warn!("cannot read the shards' leases: {e}"),
            }
            tokio::time::sleep(r.every).await;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(name: &str, id: u64) -> VolumeRec {
        VolumeRec::new(name.into(), VolRef { id, table: id, object_size_bytes: DEFAULT_OBJECT_SIZE_BYTES, parent: None }, 1 << 20, Layout::Plain, 0)
    }

    /// The state round-trips through the store as one key per volume, job and collapse record;
    /// a save writes the changes only (removed volumes and jobs lose their keys); a second
    /// store handle (a new leader) loads exactly what the last save left.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn state_round_trips_as_keys_and_removals_delete_keys() {
        let dir = tempfile::tempdir().unwrap();
        let store = control::Store::open(dir.path().to_str().unwrap(), "volume", "volume-test").await.unwrap();
        let lead = Arc::new(store.campaign(META_ELECTION, "t", Duration::from_secs(2)).await.unwrap());
        let ms = ControlMetaStore::new(store.clone(), lead.clone()).unwrap();
        assert_eq!(ms.load_async().await.unwrap(), None);
        let mut st = MetaState::new(3);
        for i in 0..5 {
            st.volumes.insert(format!("v{i}"), vol(&format!("v{i}"), i));
        }
        st.jobs.push(Job::Delete { table: 7, owner: 7, drop_table: true });
        st.jobs.push(Job::Delete { table: 8, owner: 8, drop_table: false });
        st.collapsed.push(CollapseRec { child: "c".into(), child_id: 9, outcome: crate::types::CollapseOutcome::Promoted });
        st.next_id = 10;
        ms.save_async(&st).await.unwrap();
        assert_eq!(store.list(&store.prefix("volume", "vol")).await.unwrap().len(), 5, "one key per volume");
        assert_eq!(store.list(&store.prefix("volume", "job")).await.unwrap().len(), 2, "one key per job");
        assert_eq!(store.list(&store.prefix("volume", "collapse")).await.unwrap().len(), 1);

        st.volumes.remove("v3");
        st.jobs.remove(0);
        st.map.epoch += 1;
        ms.save_async(&st).await.unwrap();
        assert_eq!(store.list(&store.prefix("volume", "vol")).await.unwrap().len(), 4, "a removed volume's key is deleted");
        assert_eq!(store.list(&store.prefix("volume", "job")).await.unwrap().len(), 1, "a finished job's key is deleted");
        assert_eq!(store.get(&store.key("volume", "state", "gen")).await.unwrap().unwrap().value, b"2");

        let fresh = ControlMetaStore::new(store.clone(), lead.clone()).unwrap();
        assert_eq!(fresh.load_async().await.unwrap().as_ref(), Some(&st));
        // A writer whose view is stale (its generation moved under it) would be a second
        // writer: the guard refuses it (the process would exit; here: the raw transaction).
        let out = lead
            .txn(vec![control::Compare::value(&store.key("volume", "state", "gen"), b"1".to_vec())], vec![control::Op::put(&store.key("volume", "state", "next_id"), b"1".to_vec())])
            .await
            .unwrap();
        assert!(!out.succeeded, "a save guarded by an old generation must not commit");
    }

    /// Jobs and collapse records keep their keys while others come and go: finishing the oldest
    /// of 200 pending jobs (or dropping the oldest collapse record) is one delete, not a rewrite
    /// of every later key (which overflowed etcd's 128 operations per transaction when jobs
    /// were keyed by their position); a new leader loads them in the order they were added.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn jobs_keep_their_keys_so_a_save_writes_only_what_changed() {
        let dir = tempfile::tempdir().unwrap();
        let store = control::Store::open(dir.path().to_str().unwrap(), "volume", "volume-test").await.unwrap();
        let lead = Arc::new(store.campaign(META_ELECTION, "t", Duration::from_secs(2)).await.unwrap());
        let ms = ControlMetaStore::new(store.clone(), lead.clone()).unwrap();
        let mut st = MetaState::new(3);
        let job = |i: u64| Job::Delete { table: i, owner: i, drop_table: i % 2 == 0 };
        let rec = |i: u64| CollapseRec { child: format!("c{i}"), child_id: i, outcome: crate::types::CollapseOutcome::Promoted };
        for i in 0..200 {
            st.jobs.push(job(i));
            st.collapsed.push(rec(i));
            ms.save_async(&st).await.unwrap();
        }
        let keys_before = store.list(&store.prefix("volume", "job")).await.unwrap();
        st.jobs.remove(0);
        st.jobs.remove(100);
        st.collapsed.drain(..3);
        st.jobs.push(job(1000));
        ms.save_async(&st).await.expect("removing old jobs is a few deletes, however many jobs wait");
        let keys_after = store.list(&store.prefix("volume", "job")).await.unwrap();
        assert_eq!(keys_after.len(), 199);
        let unchanged = keys_after.iter().filter(|kv| keys_before.iter().any(|b| b.key == kv.key && b.mod_revision == kv.mod_revision)).count();
        assert_eq!(unchanged, 198, "every job but the new one keeps its key untouched");
        let fresh = ControlMetaStore::new(store.clone(), lead.clone()).unwrap();
        assert_eq!(fresh.load_async().await.unwrap().as_ref(), Some(&st), "loaded in the order they were added");
        // The new leader's own saves go on from where the keys are.
        let mut st2 = st.clone();
        st2.jobs.remove(0);
        st2.jobs.push(job(1001));
        fresh.save_async(&st2).await.unwrap();
        let again = ControlMetaStore::new(store.clone(), lead.clone()).unwrap();
        assert_eq!(again.load_async().await.unwrap().as_ref(), Some(&st2));
    }

    /// A state that ran alone moves into the store whole, however large (here 300 volumes and
    /// 200 jobs: over 128 operations, so in several transactions), and loads back equal; a
    /// second import into a store that holds state is refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_meta_json_is_imported_whole() {
        // A long lease: the embedded store fsyncs a file per key, and 500 of them on a loaded
        // machine may take longer than a short lease (this test is not about leases).
        let dir = tempfile::tempdir().unwrap();
        let store = control::Store::open(dir.path().join("store").to_str().unwrap(), "volume", "volume-test").await.unwrap();
        let lead = Arc::new(store.campaign(META_ELECTION, "t", Duration::from_secs(60)).await.unwrap());
        let mut st = MetaState::new(3);
        for i in 0..300 {
            st.volumes.insert(format!("v{i}"), vol(&format!("v{i}"), i));
        }
        for i in 0..200 {
            st.jobs.push(Job::Delete { table: i, owner: i, drop_table: true });
        }
        st.collapsed.push(CollapseRec { child: "c".into(), child_id: 9, outcome: crate::types::CollapseOutcome::Promoted });
        st.next_id = 301;
        let ms = ControlMetaStore::new(store.clone(), lead.clone()).unwrap();
        ms.import_async(&st).await.unwrap();
        let fresh = ControlMetaStore::new(store.clone(), lead.clone()).unwrap();
        assert_eq!(fresh.load_async().await.unwrap().as_ref(), Some(&st));
        // Saves go on from the import.
        st.jobs.remove(0);
        fresh.save_async(&st).await.unwrap();
        assert_eq!(ControlMetaStore::new(store.clone(), lead.clone()).unwrap().load_async().await.unwrap().as_ref(), Some(&st));
        assert!(fresh.import_async(&st).await.is_err(), "an import over existing state is refused");
    }
}
