//! Hostile input for the witness KV, shared by the cargo-fuzz target `witness_msg`
//! (`crates/kv/fuzz`) and the property tests (`tests/witness_decoders.rs`): arbitrary bytes go
//! through every decoder a node runs on network input (the frame, `NetMsg`, the peer and client
//! decoders), and whatever decodes is delivered to a real group of cores (primary, backup,
//! witness) that has elected a leader, as a message from each member, from a stranger, and as a
//! client request. The group then runs on, exchanging its own messages, so a hostile message's
//! consequences travel. Nothing may panic, and every core checks its invariants after every
//! input (debug builds): a panic is a bug of the core.

use std::collections::{BTreeMap, VecDeque};

use crate::witness::core::config::Config;
use crate::witness::core::node::{Input, Output, Params, RoleKind, WitnessCore};
use crate::witness::driver::{NetMsg, MAX_FRAME_BYTES};
use crate::witness::proto::{self, ClientReply, ClientReq, NodeId, PeerMsg};

const MS: u64 = 1_000;
/// Inputs the harness delivers at most per call, so a message loop between hostile and honest
/// cores cannot run forever.
const MAX_STEPS_PER_RUN: usize = 20_000;

/// A primary + backup + witness group driven by hand: messages delivered in order, NVMM
/// persists acknowledged at once, SSD writes acknowledged at once and SSD reads failed (a read
/// error is input a node must survive too).
pub struct Group {
    now_us: u64,
    nodes: BTreeMap<NodeId, WitnessCore>,
    queue: VecDeque<(NodeId, Input)>,
    next_tag: u64,
    /// Replies to client requests by tag (a harness for short runs: a few hundred at most).
    replies: BTreeMap<u64, ClientReply>,
}

impl Default for Group {
    fn default() -> Self {
        Group::new()
    }
}

impl Group {
    /// A group of `Config::standard(1, 1)` that has elected a leader and committed a write.
    pub fn new() -> Group {
        let cfg = Config::standard(1, 1);
        let p = Params::default();
        let nodes = cfg
            .ids()
            .map(|id| {
                (
                    id,
                    WitnessCore::new(id, cfg.clone(), p.clone(), 0)
                        .expect("default params are valid"),
                )
            })
            .collect();
        let mut g = Group {
            now_us: 0,
            nodes,
            queue: VecDeque::new(),
            next_tag: 1,
            replies: BTreeMap::new(),
        };
        for _ in 0..2_000 {
            g.tick(MS);
            if g.leader().is_some() {
                break;
            }
        }
        let leader = g
            .leader()
            .expect("a healthy group elects a leader within 2 s");
        let _ = g.client(
            leader,
            ClientReq::Put {
                key: b"k".to_vec(),
                value: b"v".to_vec(),
            },
        );
        for _ in 0..50 {
            g.tick(MS);
        }
        g
    }

    pub fn ids(&self) -> Vec<NodeId> {
        self.nodes.keys().copied().collect()
    }

    pub fn node(&self, id: NodeId) -> &WitnessCore {
        &self.nodes[&id]
    }

    pub fn leader(&self) -> Option<NodeId> {
        self.nodes
            .iter()
            .find(|(_, n)| n.role() == RoleKind::Leader)
            .map(|(id, _)| *id)
    }

    /// Delivers `msg` to node `to` as if sent by `from` (a member or a stranger), then lets the
    /// group run.
    pub fn peer(&mut self, to: NodeId, from: NodeId, msg: PeerMsg) {
        self.queue.push_back((to, Input::Peer { from, msg }));
        self.run();
    }

    /// Sends a client request to `to`; its reply, once given, is `reply(tag)`.
    pub fn client(&mut self, to: NodeId, req: ClientReq) -> u64 {
        let tag = self.next_tag;
        self.next_tag += 1;
        self.queue.push_back((to, Input::Client { tag, req }));
        self.run();
        tag
    }

    pub fn reply(&self, tag: u64) -> Option<&ClientReply> {
        self.replies.get(&tag)
    }

    /// Advances the clock by `dt_us` and ticks every node.
    pub fn tick(&mut self, dt_us: u64) {
        self.now_us += dt_us;
        for id in self.ids() {
            self.queue.push_back((id, Input::Tick));
        }
        self.run();
    }

    fn run(&mut self) {
        for _ in 0..MAX_STEPS_PER_RUN {
            let Some((to, input)) = self.queue.pop_front() else {
                return;
            };
            let Some(node) = self.nodes.get_mut(&to) else {
                continue;
            };
            node.handle(self.now_us, input);
            for out in node.take_outputs() {
                match out {
                    Output::Send { to: dest, msg } => {
                        self.queue.push_back((dest, Input::Peer { from: to, msg }))
                    }
                    Output::PmemAppend { seq, .. } => {
                        self.queue.push_back((to, Input::PmemPersisted { seq }))
                    }
                    Output::SsdWrite { id, .. } => self
                        .queue
                        .push_back((to, Input::SsdWritten { id, result: Ok(()) })),
                    Output::SsdRead { id, .. } => self.queue.push_back((
                        to,
                        Input::SsdRead {
                            id,
                            result: Err("fuzz: no disk".into()),
                        },
                    )),
                    Output::Reply { tag, reply } => {
                        self.replies.insert(tag, reply);
                    }
                    _ => {}
                }
            }
        }
        // A bounded run: what is left is dropped, as a real network may drop it.
        self.queue.clear();
    }
}

/// Every decoder a node runs on bytes from the network, in the order a connection runs them.
/// Returns what decoded (possibly nothing).
pub fn decode_all(data: &[u8]) -> Vec<NetMsg> {
    let mut got = Vec::new();
    if let Ok(m) = wire::decode_frame::<NetMsg>(data, MAX_FRAME_BYTES) {
        got.push(m);
    }
    if let Ok(m) = wire::decode_payload::<NetMsg>(data) {
        got.push(m);
    }
    if let Ok(m) = proto::decode_peer(data) {
        got.push(NetMsg::Peer(m));
    }
    if let Ok(req) = proto::decode_client_req(data) {
        got.push(NetMsg::Req { id: 0, req });
    }
    let _ = proto::decode_client_reply(data);
    got
}

/// The fuzz target's body: bytes through every decoder, then each decoded message to every node
/// of a fresh group from every member and a stranger (id 99), then a second of ticks.
pub fn run_bytes(data: &[u8]) {
    let msgs = decode_all(data);
    if msgs.is_empty() {
        return;
    }
    let mut g = Group::new();
    let ids = g.ids();
    for m in msgs {
        for &to in &ids {
            match &m {
                NetMsg::Peer(p) => {
                    for from in ids.iter().copied().chain([99]) {
                        if from != to {
                            g.peer(to, from, p.clone());
                        }
                    }
                }
                NetMsg::Req { req, .. } => {
                    g.client(to, req.clone());
                }
                NetMsg::Hello(_) | NetMsg::Resp { .. } => {}
            }
        }
    }
    for _ in 0..100 {
        g.tick(10 * MS);
    }
}
