//! Hostile input for the network decoders, shared by the cargo-fuzz targets (`crates/volume/fuzz`)
//! and the property tests: [`Bytes`] turns arbitrary bytes into protocol messages (so a fuzzer
//! explores what a shard does with well-formed but hostile requests, not only postcard), and
//! [`CoreHarness`] feeds them to a real [`ShardCore`] over the real store on the simulator's disk, running every
//! disk command it asks for. Nothing here may panic on any input; a panic is a bug of the shard.

use crate::driver::meta::MetaReq;
use crate::core::shard::{request_id, Boot, Input, Output, Peer, ShardConfig, ShardCore};
use crate::store::{FileStore, SimFs};
use crate::types::*;

/// Reads values from fuzzer bytes; past the end every read is zero, so any input is a script.
pub struct Bytes<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Bytes<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Bytes { data, pos: 0 }
    }

    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    pub fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(std::array::from_fn(|_| self.u8()))
    }

    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(std::array::from_fn(|_| self.u8()))
    }

    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// Mostly small ids (so messages name the same volumes and objects), sometimes extremes.
    fn id(&mut self) -> u64 {
        match self.u8() % 10 {
            0 => u64::MAX,
            1 => u64::MAX - 1,
            2 => self.u64(),
            n => (n - 3) as u64 % 4,
        }
    }

    fn objno(&mut self) -> u64 {
        match self.u8() % 8 {
            0 => TRACK_OBJNO,
            1 => OBJECT_MAP_OBJNO,
            2 => self.u64(),
            n => (n - 3) as u64,
        }
    }

    fn epoch(&mut self) -> Epoch {
        match self.u8() % 6 {
            0 => 0,
            1 => u64::MAX,
            2 => 2,
            _ => 1,
        }
    }

    fn offset(&mut self) -> u32 {
        match self.u8() % 6 {
            0 => u32::MAX,
            1 => self.u32(),
            2 => 65536,
            3 => 4096 * (self.u8() % 17) as u32,
            _ => self.u8() as u32 * 512,
        }
    }

    fn len(&mut self) -> u32 {
        match self.u8() % 6 {
            0 => u32::MAX,
            1 => self.u32(),
            2 => 0,
            _ => 512 * (self.u8() % 130) as u32,
        }
    }

    fn object_size(&mut self) -> u32 {
        match self.u8() % 8 {
            0 => 0,
            1 => 3,
            2 => u32::MAX,
            3 => MAX_OBJECT_SIZE_BYTES,
            4 => MAX_OBJECT_SIZE_BYTES * 2,
            5 => 4096,
            _ => 65536,
        }
    }

    /// Payload bytes: empty, small, a whole 64 KiB object, or just over it.
    fn data(&mut self) -> Vec<u8> {
        let len = match self.u8() % 6 {
            0 => 0,
            1 => 65536,
            2 => 65537,
            3 => 4096,
            _ => self.u8() as usize * 33,
        };
        vec![self.u8() | 1; len]
    }

    fn version(&mut self) -> Version {
        Version { epoch: self.epoch(), seq: self.id() }
    }

    fn key(&mut self) -> ObjKey {
        ObjKey { table: self.id(), objno: self.objno(), owner: self.id() }
    }

    fn slot(&mut self) -> Slot {
        Slot { table: self.id(), objno: self.objno() }
    }

    fn vol(&mut self) -> VolRef {
        let id = self.id();
        VolRef { id, table: if self.bool() { id } else { self.id() }, object_size_bytes: self.object_size(), parent: self.bool().then(|| self.id()) }
    }

    fn io_op(&mut self) -> IoOp {
        match self.u8() % 3 {
            0 => IoOp::Read { offset: self.offset(), len: self.len() },
            1 => IoOp::Write { offset: self.offset(), data: self.data() },
            _ => IoOp::Zero { offset: self.offset(), len: self.len() },
        }
    }

    fn rep_op(&mut self) -> RepOp {
        match self.u8() % 3 {
            0 => RepOp::Write { offset: self.offset(), data: self.data() },
            1 => RepOp::Zero { offset: self.offset(), len: self.len() },
            _ => RepOp::Put { data: self.data() },
        }
    }

    fn track_entry(&mut self) -> TrackEntry {
        let (table, child) = (self.id(), self.id());
        match self.u8() % 3 {
            0 => TrackEntry::Tracked { table, child },
            1 => TrackEntry::Granted { table, child },
            _ => TrackEntry::Fenced { table, child },
        }
    }

    fn io_err(&mut self) -> IoErr {
        match self.u8() % 8 {
            0 => IoErr::StaleEpoch(self.epoch()),
            1 => IoErr::NotPrimary,
            2 => IoErr::NotReady,
            3 => IoErr::WriteRefused("fuzz".into()),
            4 => IoErr::NoSpace(self.u8() as u32 % 4),
            5 => IoErr::Io("fuzz".into()),
            6 => IoErr::BadRequest("fuzz".into()),
            _ => IoErr::CollapseRefused("fuzz".into()),
        }
    }

    fn reply_body(&mut self) -> Result<ReplyBody, IoErr> {
        Ok(match self.u8() % 9 {
            0 => return Err(self.io_err()),
            1 => ReplyBody::Done,
            2 => ReplyBody::Data(self.data()),
            3 => ReplyBody::Collapse(if self.bool() { CollapseOutcome::Promoted } else { CollapseOutcome::Rejected }),
            4 => ReplyBody::Granted(self.bool()),
            5 => {
                let n = self.u8() % 4;
                let objects = (0..n).map(|_| (self.key(), self.version())).collect();
                let tracks = (0..self.u8() % 3).map(|_| (self.id(), self.track_entry())).collect();
                let retired = (0..self.u8() % 3).map(|_| self.id()).collect();
                ReplyBody::Objects { objects, tracks, retired, more: self.bool() }
            }
            6 => ReplyBody::Object { version: self.version(), data: self.data() },
            7 => ReplyBody::NeedFull,
            _ => ReplyBody::Data(vec![]),
        })
    }

    fn map(&mut self) -> ClusterMap {
        let n = self.u8() % 5;
        let shards = (0..n)
            .map(|i| ShardInfo {
                id: if self.u8().is_multiple_of(8) { self.u32() } else { i as u32 + 1 },
                addr: format!("s{i}"),
                state: match self.u8() % 3 {
                    0 => ShardState::Up,
                    1 => ShardState::Recovering,
                    _ => ShardState::Down,
                },
                in_sync: self.bool(),
            })
            .collect();
        ClusterMap { epoch: self.epoch().max(1), replicas: self.u8() as u32 % 5, shards }
    }

    /// A message of any kind. Replies answer one of `recent` (request ids the shard sent) when
    /// there are any, so the fuzzer reaches the code that handles answers.
    pub fn msg(&mut self, recent: &[ReqId]) -> Msg {
        let req = if !recent.is_empty() && self.bool() { recent[self.u8() as usize % recent.len()] } else { self.id() };
        let epoch = self.epoch();
        match self.u8() % 19 {
            0..=2 => Msg::Io { req, epoch, vol: self.vol(), objno: self.objno(), op: self.io_op() },
            3 => Msg::Rep {
                req,
                epoch,
                key: self.key(),
                prev_version: self.version(),
                version: self.version(),
                op: self.rep_op(),
                cow_from: self.bool().then(|| (self.id(), self.version())),
            },
            4 => Msg::Permission { req, epoch, table: self.id(), parent: self.id() },
            5 => Msg::Super { req, epoch, table: self.id(), parent: self.id(), child: self.id() },
            6 => Msg::Track { req, epoch, parent: self.id(), entry: self.track_entry() },
            7 => Msg::Collapse { req, epoch, table: self.id(), child: self.id() },
            8 => Msg::EndSuper { req, epoch, table: self.id(), child: self.id() },
            9 => Msg::Gc { req, epoch, table: self.id(), parent: self.id(), child: self.id(), promoted: self.bool() },
            10 => Msg::DeleteVolume { req, epoch, table: self.id(), owner: self.id(), drop_table: self.bool() },
            11 => Msg::ListObjects { req, epoch, after: self.bool().then(|| self.key()) },
            12 => Msg::SlotVersions { req, epoch, slot: self.slot() },
            13 => Msg::RepDelete { req, epoch, key: self.key() },
            14 => Msg::RepSync { req, epoch, key: self.key(), version: self.version(), data: self.data() },
            15 => Msg::RepCollect { req, epoch, slot: self.slot(), from: self.id(), to: self.bool().then(|| self.id()) },
            16 => Msg::Pull { req, epoch, key: self.key() },
            17 => {
                if self.u8().is_multiple_of(4) {
                    Msg::Map(self.map())
                } else {
                    Msg::Ping { req }
                }
            }
            _ => Msg::Reply { req, result: self.reply_body() },
        }
    }

    fn name(&mut self) -> String {
        match self.u8() % 6 {
            0 => String::new(),
            1 => "x".repeat(129),
            2 => "bad/name\0".into(),
            3 => String::from_utf8_lossy(&(0..self.u8() % 16).map(|_| self.u8()).collect::<Vec<_>>()).into_owned(),
            _ => format!("v{}", self.u8() % 4),
        }
    }

    /// A control request of any kind, with hostile names and sizes.
    pub fn meta_req(&mut self) -> MetaReq {
        let size = match self.u8() % 5 {
            0 => 0,
            1 => u64::MAX,
            2 => 511,
            3 => self.u64(),
            _ => 1 << 20,
        };
        match self.u8() % 10 {
            0 => MetaReq::GetMap,
            1 => MetaReq::Create { name: self.name(), size_bytes: size, object_size_bytes: self.object_size() },
            2 => MetaReq::Delete { name: self.name() },
            3 => MetaReq::List,
            4 => MetaReq::Info { name: self.name() },
            5 => MetaReq::Resize { name: self.name(), size_bytes: size },
            6 => MetaReq::Super { parent: self.name(), child: self.name() },
            7 => MetaReq::Collapse { child: self.name() },
            8 => MetaReq::CloneGeneral { parent: self.name(), child: self.name() },
            _ => MetaReq::Jobs,
        }
    }
}

/// Disk commands and ticks run per fed message, at most (a core that keeps asking for more is
/// itself a finding, but must not hang the fuzzer).
const MAX_STEPS_PER_MESSAGE: usize = 10_000;

/// A shard core (shard 1 of three, all up) over the store on the simulator's disk, driven to quiescence after
/// every message: disk commands run at once, sends are recorded and dropped.
pub struct CoreHarness {
    pub core: ShardCore,
    pub store: FileStore<SimFs>,
    now_us: u64,
    /// Request ids of the last messages the shard sent (replies may answer them).
    pub recent_reqs: Vec<ReqId>,
    /// Replies sent to clients, as (connection, request id, result is ok).
    pub client_replies: Vec<(u64, ReqId, bool)>,
}

impl Default for CoreHarness {
    fn default() -> Self {
        Self::new()
    }
}

impl CoreHarness {
    pub fn new() -> Self {
        let mut h = CoreHarness {
            core: ShardCore::new(ShardConfig::new(1), Boot::default()),
            store: FileStore::simulated(SimFs::new()).expect("a store on an empty simulated disk opens"),
            now_us: 0,
            recent_reqs: vec![],
            client_replies: vec![],
        };
        let map = ClusterMap {
            epoch: 1,
            replicas: 3,
            shards: (1..=3).map(|id| ShardInfo { id, addr: format!("s{id}"), state: ShardState::Up, in_sync: true }).collect(),
        };
        h.feed(Peer::Meta, Msg::Map(map));
        h
    }

    /// Feeds one message and runs what it causes.
    pub fn feed(&mut self, from: Peer, msg: Msg) {
        self.core.handle(self.now_us, Input::Msg { from, msg });
        let mut pending = self.core.take_outputs();
        for _ in 0..MAX_STEPS_PER_MESSAGE {
            let Some(out) = pending.pop() else { break };
            match out {
                Output::Disk { id, cmd } => {
                    let result = self.store.run(cmd);
                    self.core.handle(self.now_us, Input::Disk { id, result });
                    pending.extend(self.core.take_outputs());
                }
                Output::Send { to, msg } => {
                    match (&to, &msg) {
                        (Peer::Client(c), Msg::Reply { req, result }) => self.client_replies.push((*c, *req, result.is_ok())),
                        (_, Msg::Reply { .. }) => {}
                        (_, m) => {
                            if let Some(req) = request_id(m) {
                                if self.recent_reqs.len() >= 16 {
                                    self.recent_reqs.remove(0);
                                }
                                self.recent_reqs.push(req);
                            }
                        }
                    }
                }
            }
        }
        self.now_us += 50_000;
        self.core.handle(self.now_us, Input::Tick);
        let ticks = self.core.take_outputs();
        // Resends after the tick are sends only; any disk command they start runs next time.
        for out in ticks {
            if let Output::Disk { id, cmd } = out {
                let result = self.store.run(cmd);
                self.core.handle(self.now_us, Input::Disk { id, result });
                let _ = self.core.take_outputs();
            }
        }
    }

    /// Runs a whole fuzz script: messages from a client, two peer shards and the metadata
    /// service, each encoded and decoded as on the wire (the round trip must be exact).
    pub fn run_script(data: &[u8]) {
        let mut b = Bytes::new(data);
        let mut h = CoreHarness::new();
        for _ in 0..64 {
            if b.is_empty() {
                break;
            }
            let from = match b.u8() % 5 {
                0 | 1 => Peer::Client(7),
                2 => Peer::Shard(2),
                3 => Peer::Shard(3),
                _ => Peer::Meta,
            };
            let msg = b.msg(&h.recent_reqs);
            let frame = wire::encode_frame(&msg).expect("every message encodes");
            let back: Msg = wire::decode_frame(&frame, wire::MAX_FRAME_PAYLOAD_BYTES).expect("an encoded message decodes");
            assert_eq!(back, msg, "wire round trip");
            h.feed(from, back);
        }
    }
}
