//! The async clients: [`KvClient`] (one node, many requests in flight on one connection) and
//! [`KvCluster`] (a whole group).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use crate::leaderless::proto::*;

use super::*;

pub(super) type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<ClientResult>>>>;

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
        let s = tokio::time::timeout(Duration::from_secs(2), dial(addr, secret, Hello::Client, None))
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
        value_of(self.call(get_op(key)).await?)
    }

    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        done_of(self.call(put_op(key, value)).await?)
    }

    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

pub(super) fn refusal(r: ClientResult) -> KvError {
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

    /// The connection to node `i`, made if there is none. The dial runs outside the lock (one
    /// lock for every node: a dial to a dead host takes up to the connect bound, and every
    /// other node's callers would wait behind it), and a dial that fails skips the node for as
    /// long as the attempt took, at least [`UNREACHABLE_SKIP_MS`]: a refusing port is tried
    /// again soon, a host that does not answer at all (dead, cut off) is not dialled by every
    /// caller in turn.
    async fn conn(&self, i: usize) -> Result<KvClient, KvError> {
        if let Some(c) = &self.conns.lock().await[i] {
            if !c.is_closed() {
                return Ok(c.clone());
            }
        }
        let started = Instant::now();
        match KvClient::connect(self.addrs[i], &self.secret).await {
            Ok(c) => {
                let mut g = self.conns.lock().await;
                // Another caller may have connected meanwhile: keep one connection.
                match &g[i] {
                    Some(other) if !other.is_closed() => Ok(other.clone()),
                    _ => {
                        g[i] = Some(c.clone());
                        Ok(c)
                    }
                }
            }
            Err(e) => {
                self.skip(i, UNREACHABLE_SKIP_MS.max(started.elapsed().as_millis() as u64));
                Err(e)
            }
        }
    }

    /// Forgets the connection to node `i` if it is still `c`.
    async fn drop_conn(&self, i: usize, c: &KvClient) {
        let mut g = self.conns.lock().await;
        if g[i].as_ref().is_some_and(|k| Arc::ptr_eq(&k.pending, &c.pending)) {
            g[i] = None;
        }
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
                    Err(KvError::Timeout(d)) => {
                        // A node silent for the whole timeout may be gone without a word (its
                        // host died or was cut off: no reset ever comes). Later operations go
                        // elsewhere for as long, and the next one to pick it dials afresh;
                        // without this every operation that picked it waited the timeout out.
                        self.skip(i, d.as_millis() as u64);
                        self.drop_conn(i, &c).await;
                        return Err(KvError::Timeout(d));
                    }
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
        value_of(self.call(get_op(key)).await?)
    }

    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        done_of(self.call(put_op(key, value)).await?)
    }
}

/// The file `kv up` writes so that clients find the group.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct KvClusterFile {
    pub model: String,
    pub nodes: BTreeMap<NodeId, SocketAddr>,
    pub secret_file: PathBuf,
}

// A get and a put as requests and answers, one definition for both clients (a `KvClient` on one
// node, a `KvCluster` that goes on to the next node): only how a request travels differs.

fn get_op(key: &[u8]) -> ClientOp {
    ClientOp::Get { key: key.to_vec() }
}

fn put_op(key: &[u8], value: &[u8]) -> ClientOp {
    ClientOp::Put { key: key.to_vec(), value: value.to_vec(), scope: None }
}

fn value_of(result: ClientResult) -> Result<Option<Vec<u8>>, KvError> {
    match result {
        ClientResult::Value(v) => Ok(v),
        other => Err(refusal(other)),
    }
}

fn done_of(result: ClientResult) -> Result<(), KvError> {
    match result {
        ClientResult::Done => Ok(()),
        other => Err(refusal(other)),
    }
}
