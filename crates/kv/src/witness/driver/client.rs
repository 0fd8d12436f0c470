//! The witness-KV client: sends each request to the node it believes leads, follows
//! `NotLeader{hint}`, tries the next node when a node is unreachable or names no leader, and
//! retries `Unavailable` (a provisional or recovering leader) until its deadline.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::*;
use crate::witness::proto::{Change, Config};
use crate::witness::proto::StatusReport;

/// How long one request may take, retries included, before the client gives up.
pub const CLIENT_DEADLINE_DEFAULT: Duration = Duration::from_secs(10);
/// One node's answer is awaited this long before the client tries another.
pub const CLIENT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(1);
/// Pause before retrying after `Unavailable` or a node that names no leader.
pub const CLIENT_RETRY_PAUSE: Duration = Duration::from_millis(10);

pub struct WitnessClient {
    nodes: BTreeMap<NodeId, SocketAddr>,
    secret: Vec<u8>,
    leader: NodeId,
    conn: Option<(NodeId, wire::link::Link)>,
    next_id: u64,
    pub deadline: Duration,
}

impl WitnessClient {
    pub fn new(nodes: BTreeMap<NodeId, SocketAddr>, secret: Vec<u8>) -> WitnessClient {
        let leader = nodes.keys().next().copied().unwrap_or(0);
        WitnessClient {
            nodes,
            secret,
            leader,
            conn: None,
            next_id: 1,
            deadline: CLIENT_DEADLINE_DEFAULT,
        }
    }

    /// The node the client currently sends to.
    pub fn leader_guess(&self) -> NodeId {
        self.leader
    }

    pub async fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, WitnessError> {
        match self.call(ClientReq::Get { key: key.to_vec() }).await? {
            ClientReply::Value(v) => Ok(v.map(|b| b.into_vec())),
            r => Err(WitnessError::Refused(format!("unexpected reply to a get: {r:?}"))),
        }
    }

    pub async fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), WitnessError> {
        let req = ClientReq::Put {
            key: key.to_vec(),
            value: value.to_vec(),
        };
        match self.call(req).await? {
            ClientReply::PutOk => Ok(()),
            r => Err(WitnessError::Refused(format!("unexpected reply to a put: {r:?}"))),
        }
    }

    /// Submits a membership change to the leader and waits until it commits (`kv reconfig`):
    /// the configuration then in force, or why it was refused (`Refused`), or `Unavailable`
    /// when no leader took it before the deadline (another change pending all along).
    pub async fn reconfigure(&mut self, change: Change) -> Result<Config, WitnessError> {
        match self.call(ClientReq::Reconfigure(change)).await? {
            ClientReply::Reconfigured(c) => Ok(c),
            r => Err(WitnessError::Refused(format!("unexpected reply to a change: {r:?}"))),
        }
    }

    /// Node `node`'s own view of the membership, leader or not: (its configuration, the
    /// leader it follows, whether it serves as leader).
    pub async fn membership(&mut self, node: NodeId) -> Result<(Config, Option<NodeId>, bool), WitnessError> {
        let id = self.next_id;
        self.next_id += 1;
        let r = tokio::time::timeout(CLIENT_ATTEMPT_TIMEOUT, self.attempt(node, id, &ClientReq::Membership)).await;
        match r {
            Ok(Ok(ClientReply::Membership { config, leader, serving })) => Ok((config, leader, serving)),
            Ok(Ok(r)) => Err(WitnessError::Refused(format!("unexpected reply to a membership request: {r:?}"))),
            Ok(Err(Attempt::NotSent(e) | Attempt::Sent(e))) => {
                self.conn = None;
                Err(WitnessError::Unavailable(format!("node {node}: {e}")))
            }
            Err(_) => {
                self.conn = None;
                Err(WitnessError::Unavailable(format!("node {node}: no answer within {CLIENT_ATTEMPT_TIMEOUT:?}")))
            }
        }
    }

    /// One node's status (`kv status`, `bench kv ttr`): asked of `node` itself, leader or not,
    /// once, within [`CLIENT_ATTEMPT_TIMEOUT`].
    pub async fn node_status(&mut self, node: NodeId) -> Result<StatusReport, WitnessError> {
        let id = self.next_id;
        self.next_id += 1;
        let r = tokio::time::timeout(CLIENT_ATTEMPT_TIMEOUT, self.attempt(node, id, &ClientReq::Status)).await;
        match r {
            Ok(Ok(ClientReply::Status(s))) => Ok(*s),
            Ok(Ok(other)) => Err(WitnessError::Refused(format!("node {node} answered a status request with {other:?}"))),
            Ok(Err(Attempt::NotSent(e) | Attempt::Sent(e))) => {
                self.conn = None;
                Err(WitnessError::Unavailable(format!("node {node}: {e}")))
            }
            Err(_) => {
                self.conn = None;
                Err(WitnessError::Unavailable(format!("node {node}: no answer within {CLIENT_ATTEMPT_TIMEOUT:?}")))
            }
        }
    }

    /// Every node's status, in id order; a node that does not answer is its error.
    pub async fn all_status(&mut self) -> Vec<(NodeId, Result<StatusReport, WitnessError>)> {
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            out.push((id, self.node_status(id).await));
        }
        out
    }

    fn next_node(&mut self) {
        let after = self.nodes.range(self.leader + 1..).next().map(|(k, _)| *k);
        self.leader = after.or_else(|| self.nodes.keys().next().copied()).unwrap_or(0);
    }

    /// Sends `req` until a node answers it as leader. A put whose connection failed after it
    /// was sent is not retried (it may have taken effect): that is `Indeterminate`.
    async fn call(&mut self, req: ClientReq) -> Result<ClientReply, WitnessError> {
        let t0 = Instant::now();
        let is_put = matches!(req, ClientReq::Put { .. });
        let mut last = String::from("no attempt");
        while t0.elapsed() < self.deadline {
            let target = self.leader;
            let id = self.next_id;
            self.next_id += 1;
            let r = tokio::time::timeout(CLIENT_ATTEMPT_TIMEOUT, self.attempt(target, id, &req)).await;
            match r {
                Ok(Ok(reply)) => match reply {
                    ClientReply::NotLeader { hint: Some(h) } if h != target && self.nodes.contains_key(&h) => {
                        self.leader = h;
                        last = format!("node {target} is not the leader (hint {h})");
                    }
                    ClientReply::NotLeader { .. } => {
                        last = format!("node {target} is not the leader and knows none");
                        self.next_node();
                        tokio::time::sleep(CLIENT_RETRY_PAUSE).await;
                    }
                    ClientReply::Unavailable => {
                        last = format!("node {target} cannot serve yet");
                        tokio::time::sleep(CLIENT_RETRY_PAUSE).await;
                    }
                    ClientReply::Indeterminate => {
                        return Err(WitnessError::Indeterminate(format!("node {target} lost leadership before the put committed")))
                    }
                    ClientReply::Invalid(why) => return Err(WitnessError::Refused(why)),
                    other => return Ok(other),
                },
                Ok(Err(Attempt::NotSent(e))) => {
                    last = format!("node {target}: {e}");
                    self.conn = None;
                    self.next_node();
                    tokio::time::sleep(CLIENT_RETRY_PAUSE).await;
                }
                Ok(Err(Attempt::Sent(e))) => {
                    self.conn = None;
                    if is_put {
                        return Err(WitnessError::Indeterminate(format!("node {target}: {e}")));
                    }
                    last = format!("node {target}: {e}");
                    self.next_node();
                }
                Err(_) => {
                    self.conn = None;
                    if is_put {
                        return Err(WitnessError::Indeterminate(format!("node {target}: no answer within {CLIENT_ATTEMPT_TIMEOUT:?}")));
                    }
                    last = format!("node {target}: no answer within {CLIENT_ATTEMPT_TIMEOUT:?}");
                    self.next_node();
                }
            }
        }
        Err(WitnessError::Unavailable(format!("after {:?}: {last}", self.deadline)))
    }

    async fn attempt(&mut self, target: NodeId, id: u64, req: &ClientReq) -> Result<ClientReply, Attempt> {
        if self.conn.as_ref().map(|(n, _)| *n) != Some(target) {
            self.conn = None;
            let addr = *self.nodes.get(&target).ok_or_else(|| Attempt::NotSent(format!("unknown node {target}")))?;
            let s = node::dial(addr, &self.secret, Hello::Client).await.map_err(|e| Attempt::NotSent(e.to_string()))?;
            self.conn = Some((target, s));
        }
        let (_, s) = self.conn.as_mut().expect("connected above");
        wire::write_msg(s, &NetMsg::Req { id, req: req.clone() })
            .await
            .map_err(|e| Attempt::NotSent(e.to_string()))?;
        tokio::io::AsyncWriteExt::flush(s).await.map_err(|e| Attempt::NotSent(e.to_string()))?;
        loop {
            match wire::read_msg::<NetMsg, _>(s, MAX_FRAME_BYTES).await {
                Ok(NetMsg::Resp { id: rid, reply }) if rid == id => return Ok(reply),
                Ok(NetMsg::Resp { .. }) => continue, // an answer to an abandoned attempt
                Ok(m) => return Err(Attempt::Sent(format!("unexpected message {m:?}"))),
                Err(e) => return Err(Attempt::Sent(e.to_string())),
            }
        }
    }
}

enum Attempt {
    /// Failed before the request could reach the node: safe to retry anywhere.
    NotSent(String),
    /// Failed after sending: a put may have taken effect.
    Sent(String),
}
