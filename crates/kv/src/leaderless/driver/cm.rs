//! The configuration manager's server: runs [`CmCore`] with its durable state file and one
//! heartbeat link per node.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::leaderless::core::cm::{CmCore, CmInput, CmOutput, CmParams};
use crate::leaderless::proto::*;
use crate::pmlog::{self, LogRecord};

use super::*;

#[derive(Clone, Debug)]
pub struct CmConfig {
    pub params: CmParams,
    pub nodes: BTreeMap<NodeId, SocketAddr>,
    pub data_dir: PathBuf,
    pub secret: Vec<u8>,
    pub metrics: Option<SocketAddr>,
    /// Run with standbys on the control store (None: alone, on `data_dir/cm.state`).
    pub control: Option<CmControl>,
}

pub(super) fn load_cm_state(path: &Path) -> Result<Option<Config>, KvError> {
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

pub(super) fn save_cm_state(path: &Path, c: &Config) -> Result<(), KvError> {
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

/// Where the CM keeps its configuration and how it stands for leadership, when it runs with
/// standbys on the control store (`kv cm --store URL`).
#[derive(Clone, Debug)]
pub struct CmControl {
    /// The control store's address (`etcd://...`, or an embedded directory).
    pub store_url: String,
    /// The cluster name in the store's keys.
    pub cluster: String,
    /// The cluster's identity: a store holding another one is refused.
    pub cluster_id: String,
    /// The election lease: a leader that cannot renew it for this long stops acting; a standby
    /// takes over about this long after the leader died.
    pub election_ttl: Duration,
    /// What this CM tells others when it leads (shown by `observe`).
    pub advertise: String,
}

/// The election every CM of one kv cluster stands in.
pub const CM_ELECTION: &str = "kv-cm";

/// The cluster id a CM derives from the group's secret when none is given: two groups with
/// different secrets never share one store's keys under one cluster name. A checksum of the
/// secret, not the secret: the store's readers need not know it.
pub fn cluster_id_from_secret(secret: &[u8]) -> String {
    control::daemon::cluster_id_from_secret("kv", secret)
}

/// How the configuration is made durable: today's state file, or guarded writes of the leader.
enum Persist<'a> {
    File(PathBuf),
    Leader { lead: &'a control::Leadership, store: &'a control::Store },
}

/// The configuration as keys: `kv/cm/epoch` (decimal) and one `kv/node/<id>` per node holding
/// `active`, `recovering` or `removed` (one small key per node, never one blob that grows with
/// the group). Every write of it is one transaction guarded by the epoch it replaces and by the
/// writer's election key.
fn epoch_key(store: &control::Store) -> String {
    store.key("kv", "cm", "epoch")
}

fn node_key(store: &control::Store, n: NodeId) -> String {
    store.key("kv", "node", &format!("{n:05}"))
}

/// Reads the configuration a previous leader left (None: no leader ever persisted one).
pub async fn load_cm_config(store: &control::Store, nodes: u32) -> Result<Option<Config>, KvError> {
    let Some(e) = store.get(&epoch_key(store)).await? else { return Ok(None) };
    let bad = |why: String| KvError::Refused(format!("kv configuration in the control store: {why}"));
    let epoch: u64 = std::str::from_utf8(&e.value).ok().and_then(|s| s.parse().ok()).ok_or_else(|| bad(format!("epoch {:?} is not a number", String::from_utf8_lossy(&e.value))))?;
    let prefix = store.prefix("kv", "node");
    let mut c = Config { epoch, nodes: Vec::new(), active: Default::default(), recovering: Default::default() };
    for kv in store.list(&prefix).await? {
        let n: NodeId = kv.key[prefix.len()..].parse().map_err(|_| bad(format!("bad node key {}", kv.key)))?;
        c.nodes.push(n);
        match kv.value.as_slice() {
            b"active" => {
                c.active.insert(n);
            }
            b"recovering" => {
                c.recovering.insert(n);
            }
            b"removed" => {}
            v => return Err(bad(format!("node {n} has state {:?}", String::from_utf8_lossy(v)))),
        }
    }
    c.nodes.sort_unstable();
    if c.nodes != (0..nodes).collect::<Vec<_>>() {
        return Err(bad(format!("it names nodes {:?}, this CM was given {nodes} (--nodes)", c.nodes)));
    }
    Ok(Some(c))
}

/// Writes `c` as the successor of epoch `prev` (None: the first configuration), guarded by the
/// leadership: a deposed leader gets [`control::Error::Deposed`].
async fn persist_led(lead: &control::Leadership, store: &control::Store, prev: Option<u64>, c: &Config) -> Result<(), KvError> {
    use control::{Compare, Op};
    let ek = epoch_key(store);
    let guard = match prev {
        Some(p) => Compare::value(&ek, p.to_string().into_bytes()),
        None => Compare::absent(&ek),
    };
    let mut ops = vec![Op::put(&ek, c.epoch.to_string().into_bytes())];
    for &n in &c.nodes {
        let state: &[u8] = if c.active.contains(&n) {
            b"active"
        } else if c.recovering.contains(&n) {
            b"recovering"
        } else {
            b"removed"
        };
        ops.push(Op::put(&node_key(store, n), state.to_vec()));
    }
    let out = lead.txn(vec![guard], ops).await?;
    if !out.succeeded {
        // Only a leader writes, and each one reads the epoch after winning: another epoch here
        // means a second writer outside the election. Stop rather than fork.
        return Err(KvError::Refused(format!("kv configuration epoch in the control store is no longer {prev:?}: another writer outside the election; stepping down")));
    }
    Ok(())
}

/// Runs the configuration manager until the process is stopped: alone on its state file, or,
/// with [`CmConfig::control`], as a candidate that runs the CM only while it leads.
pub async fn run_cm(cfg: CmConfig) -> Result<(), KvError> {
    let epoch = Arc::new(AtomicU64::new(0));
    let leading = Arc::new(AtomicU64::new(0));
    if let Some(m) = cfg.metrics {
        let l = TcpListener::bind(m).await?;
        let (epoch, leading) = (epoch.clone(), leading.clone());
        tokio::spawn(wire::metrics::serve(l, move || {
            let e = epoch.load(Ordering::Relaxed);
            let lead = leading.load(Ordering::Relaxed);
            async move {
                let mut out = String::new();
                wire::metrics::metric(&mut out, "kv_cm_epoch", "gauge", "configuration epoch", &[("", e as f64)]);
                wire::metrics::metric(&mut out, "kv_cm_leading", "gauge", "1 while this CM leads (runs the group), 0 while a standby", &[("", lead as f64)]);
                out
            }
        }));
    }
    let Some(ctl) = cfg.control.clone() else {
        std::fs::create_dir_all(&cfg.data_dir)?;
        let state_path = cfg.data_dir.join("cm.state");
        let durable = load_cm_state(&state_path)?;
        if let Some(c) = &durable {
            tracing::info!(epoch = c.epoch, "CM restarting from its durable configuration");
        }
        leading.store(1, Ordering::Relaxed);
        let why = lead(&cfg, durable, Persist::File(state_path), &epoch).await?;
        return Err(KvError::Refused(why));
    };
    let store = control::Store::open(&ctl.store_url, &ctl.cluster, &ctl.cluster_id).await?;
    loop {
        let leadership = control::daemon::campaign_until_leading(&store, CM_ELECTION, &ctl.advertise, ctl.election_ttl, |lost| match lost {
            None => eprintln!("cm: standing for leadership of {CM_ELECTION} as {}", ctl.advertise),
            // The store was out of reach long enough to lose the candidacy: stand again.
            Some(e) => eprintln!("cm: candidacy lost ({e}); standing again"),
        })
        .await?;
        // The previous leader can no longer write (its election key is gone): what is read now
        // is the last configuration it persisted.
        let durable = match load_cm_config(&store, cfg.nodes.len() as u32).await {
            Ok(d) => d,
            Err(KvError::Control(e)) => {
                eprintln!("cm: cannot read the configuration ({e}); resigning");
                let _ = leadership.resign().await;
                continue;
            }
            Err(e) => return Err(e),
        };
        eprintln!(
            "cm: leading {CM_ELECTION} (fencing token {}), configuration epoch {}",
            leadership.fencing_token(),
            durable.as_ref().map_or("none yet (genesis)".to_string(), |c| c.epoch.to_string())
        );
        leading.store(1, Ordering::Relaxed);
        let r = lead(&cfg, durable, Persist::Leader { lead: &leadership, store: &store }, &epoch).await;
        leading.store(0, Ordering::Relaxed);
        match r {
            Ok(why) => eprintln!("cm: no longer leading ({why}): standing by"),
            Err(KvError::Control(e)) => eprintln!("cm: no longer leading ({e}): standing by"),
            Err(e) => return Err(e),
        }
        // Give the election key up if it is still ours (a failed write): the next leader need
        // not wait for its lease to run out.
        let _ = leadership.resign().await;
    }
}

/// The heartbeat links, stopped when the CM stops leading (their connections close at once).
struct Links(Vec<tokio::task::JoinHandle<()>>);

impl Drop for Links {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Runs [`CmCore`] while it may act: for ever on a state file; with a leadership, until it is
/// lost (returns why) or a guarded write fails (the error). Nothing is sent after either.
async fn lead(cfg: &CmConfig, durable: Option<Config>, persist: Persist<'_>, epoch: &Arc<AtomicU64>) -> Result<String, KvError> {
    let start = Instant::now();
    let now_us = || start.elapsed().as_micros() as u64;
    let mut last_epoch = durable.as_ref().map(|c| c.epoch);
    if let Some(e) = last_epoch {
        epoch.store(e, Ordering::Relaxed);
    }
    let mut cm = CmCore::new(cfg.params.clone(), durable, cfg.nodes.len() as u32, now_us());
    let (ack_tx, mut ack_rx) = mpsc::channel::<HeartbeatAck>(ACK_QUEUE_LEN);
    let mut hb_tx: HashMap<NodeId, mpsc::Sender<Heartbeat>> = HashMap::new();
    let mut links = Links(Vec::new());
    for (&id, &addr) in &cfg.nodes {
        let (tx, rx) = mpsc::channel(HB_QUEUE_LEN);
        hb_tx.insert(id, tx);
        links.0.push(tokio::spawn(cm_link(addr, cfg.secret.clone(), rx, ack_tx.clone())));
    }
    let leadership = match &persist {
        Persist::Leader { lead, .. } => Some(*lead),
        Persist::File(_) => None,
    };
    let mut tick = tokio::time::interval(Duration::from_micros(cfg.params.heartbeat_interval_us.max(1000)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // A loop that did not run for this long (the process stopped, or starved) may have outlived
    // its election lease before the renewal task could say so: it confirms its leadership in
    // the store before it sends anything more.
    let confirm_after = cfg.control.as_ref().map(|c| c.election_ttl / 4);
    let mut last_turn = Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => cm.handle(now_us(), CmInput::Tick),
            Some(a) = ack_rx.recv() => cm.handle(now_us(), CmInput::Ack(a)),
            why = async { leadership.unwrap().lost().await }, if leadership.is_some() => return Ok(why),
        }
        let gap = last_turn.elapsed();
        last_turn = Instant::now();
        if let (Some(l), Some(limit)) = (leadership, confirm_after) {
            if gap > limit {
                eprintln!("cm: the CM did not run for {} ms: confirming its leadership first", gap.as_millis());
                l.txn(vec![], vec![]).await?;
                last_turn = Instant::now();
            }
        }
        for o in cm.take_outputs() {
            // The lease is checked before every output: a leader that may have been replaced
            // sends nothing more (its heartbeats would extend the nodes' read leases under a
            // configuration the new leader may be replacing).
            if let Some(l) = leadership {
                if !l.is_leader() {
                    return Ok("election lease lost".to_string());
                }
            }
            match o {
                CmOutput::Persist(c) => {
                    match &persist {
                        Persist::File(path) => save_cm_state(path, &c)?,
                        Persist::Leader { lead, store } => persist_led(lead, store, last_epoch, &c).await?,
                    }
                    last_epoch = Some(c.epoch);
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

/// Acks waiting for the CM's loop, from all nodes (a few per heartbeat per node).
const ACK_QUEUE_LEN: usize = 65_536;
/// Heartbeats waiting for one node's link; more are dropped (the next one carries the same).
const HB_QUEUE_LEN: usize = 64;

pub(super) async fn cm_link(
    addr: SocketAddr,
    secret: Vec<u8>,
    mut rx: mpsc::Receiver<Heartbeat>,
    acks: mpsc::Sender<HeartbeatAck>,
) {
    loop {
        let conn = dial(addr, &secret, Hello::Cm, None);
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
                    // Over TLS the heartbeat's record may wait in the session until a flush.
                    if tokio::io::AsyncWriteExt::flush(&mut w).await.is_err() { break; }
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

#[cfg(test)]
mod tests {
    use super::*;

    async fn store(dir: &Path) -> control::Store {
        control::Store::open(dir.to_str().unwrap(), "t", "id-1").await.unwrap()
    }

    /// The configuration goes to the store as keys under the leader's guard and comes back
    /// whole; a write that does not follow the stored epoch is refused.
    #[tokio::test]
    async fn the_configuration_round_trips_through_the_store_under_the_epoch_guard() {
        let tmp = tempfile::tempdir().unwrap();
        let s = store(tmp.path()).await;
        assert_eq!(load_cm_config(&s, 3).await.unwrap(), None);
        let lead = s.campaign(CM_ELECTION, "me", Duration::from_secs(5)).await.unwrap();
        let mut c = Config::genesis(3);
        persist_led(&lead, &s, None, &c).await.unwrap();
        assert_eq!(load_cm_config(&s, 3).await.unwrap().as_ref(), Some(&c));
        c.epoch = 3;
        c.active.remove(&1);
        c.recovering.insert(1);
        // Skipping epoch 2's write: the guard (the stored epoch is 1, not 2) refuses it.
        let e = persist_led(&lead, &s, Some(2), &c).await.unwrap_err();
        assert!(e.to_string().contains("another writer"), "{e}");
        persist_led(&lead, &s, Some(1), &c).await.unwrap();
        let back = load_cm_config(&s, 3).await.unwrap().unwrap();
        assert_eq!(back, c);
        assert_eq!(s.list(&s.prefix("kv", "node")).await.unwrap().len(), 3, "one key per node");
        // A CM given another group size refuses the stored configuration.
        let e = load_cm_config(&s, 5).await.unwrap_err();
        assert!(e.to_string().contains("names nodes [0, 1, 2]"), "{e}");
    }

    /// A leader whose lease was lost cannot write the configuration: its write is refused as
    /// deposed, and the stored configuration stays what it was.
    #[tokio::test]
    async fn a_deposed_leader_cannot_persist() {
        let tmp = tempfile::tempdir().unwrap();
        let s = store(tmp.path()).await;
        let lead = s.campaign(CM_ELECTION, "me", Duration::from_secs(1)).await.unwrap();
        let c = Config::genesis(3);
        persist_led(&lead, &s, None, &c).await.unwrap();
        lead.stop_renewing();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let mut next = c.clone();
        next.epoch = 2;
        next.active.remove(&2);
        let e = persist_led(&lead, &s, Some(1), &next).await.unwrap_err();
        assert!(matches!(e, KvError::Control(control::Error::Deposed { .. })), "{e}");
        assert_eq!(load_cm_config(&s, 3).await.unwrap(), Some(c));
    }
}
