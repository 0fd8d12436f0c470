//! Property test: random sequences of parent and child I/O, `super`, `collapse` (both outcomes),
//! the metadata service's abort (mark written, then collapse: always rejected) and garbage
//! collection, run on real shard cores (synchronous delivery, no faults), compared
//! read by read against a simple in-memory model of what each volume must hold.

use std::collections::VecDeque;

use proptest::prelude::*;
use volume::core::shard::*;
use volume::store::{FileStore, SimFs};
use volume::types::*;

const SHARDS: u32 = 4;
const OBJECT_BYTES: u32 = 4096;
const OBJECTS: u64 = 4;
const TABLE: TableId = 9;
const CLIENT: u64 = 1;

struct Cluster {
    shards: Vec<(ShardCore, FileStore<SimFs>)>,
    map: ClusterMap,
    next_req: u64,
}

enum Dest {
    Shard(ShardId),
}

impl Cluster {
    fn new() -> Cluster {
        let map = ClusterMap {
            epoch: 1,
            replicas: 3,
            shards: (0..SHARDS).map(|id| ShardInfo { id, addr: String::new(), state: ShardState::Up, in_sync: true }).collect(),
        };
        let mut shards: Vec<(ShardCore, FileStore<SimFs>)> = (0..SHARDS)
            .map(|id| (ShardCore::new(ShardConfig::new(id), Boot::default()), FileStore::simulated(SimFs::new()).unwrap()))
            .collect();
        for (core, _) in shards.iter_mut() {
            core.handle(0, Input::Msg { from: Peer::Meta, msg: Msg::Map(map.clone()) });
            assert!(core.take_outputs().is_empty());
        }
        Cluster { shards, map, next_req: 1 << 50 }
    }

    /// Sends one request and runs the cluster until it is quiet; returns the reply.
    fn call(&mut self, dest: Dest, make: impl FnOnce(ReqId) -> Msg, from: Peer) -> Result<ReplyBody, IoErr> {
        self.next_req += 1;
        let req = self.next_req;
        let Dest::Shard(first) = dest;
        let mut queue: VecDeque<(Peer, ShardId, Msg)> = VecDeque::from([(from, first, make(req))]);
        let mut reply = None;
        while let Some((from, to, msg)) = queue.pop_front() {
            let mut inputs = VecDeque::from([Input::Msg { from, msg }]);
            while let Some(input) = inputs.pop_front() {
                let (core, store) = &mut self.shards[to as usize];
                core.handle(0, input);
                let outs = core.take_outputs();
                core.check_invariants_deep();
                for out in outs {
                    match out {
                        Output::Send { to: Peer::Shard(s), msg } => queue.push_back((Peer::Shard(to), s, msg)),
                        Output::Send { to: _, msg: Msg::Reply { req: r, result } } if r == req => reply = Some(result),
                        Output::Send { .. } => {}
                        Output::Disk { id, cmd } => {
                            let result = store.run(cmd);
                            inputs.push_back(Input::Disk { id, result });
                        }
                    }
                }
            }
        }
        for (core, _) in &self.shards {
            assert_eq!(core.ops_in_flight(), 0, "shard {} not idle: {}", core.id(), core.debug_ops());
        }
        reply.expect("no reply")
    }

    fn io(&mut self, vol: &VolRef, objno: u64, op: IoOp) -> Result<ReplyBody, IoErr> {
        let p = self.map.primary(Slot { table: vol.table, objno }).unwrap();
        let (epoch, vol) = (self.map.epoch, vol.clone());
        self.call(Dest::Shard(p), |req| Msg::Io { req, epoch, vol, objno, op }, Peer::Client(CLIENT))
    }

    fn tracking(&mut self, make: impl FnOnce(ReqId, Epoch) -> Msg) -> Result<ReplyBody, IoErr> {
        let p = self.map.primary(Slot { table: TABLE, objno: TRACK_OBJNO }).unwrap();
        let epoch = self.map.epoch;
        self.call(Dest::Shard(p), |req| make(req, epoch), Peer::Meta)
    }

    fn all(&mut self, make: impl Fn(ReqId, Epoch) -> Msg) {
        let epoch = self.map.epoch;
        for s in 0..SHARDS {
            let r = self.call(Dest::Shard(s), |req| make(req, epoch), Peer::Meta);
            assert_eq!(r, Ok(ReplyBody::Done));
        }
    }

    fn objects_of(&self, owner: VolId) -> usize {
        self.shards.iter().map(|(c, _)| c.objects().keys().filter(|k| k.owner == owner).count()).sum()
    }
}

#[derive(Debug, Clone)]
enum Op {
    Write { child: bool, objno: u64, offset: u32, len: u32, byte: u8 },
    Zero { child: bool, objno: u64, offset: u32, len: u32 },
    Read { child: bool, objno: u64, offset: u32, len: u32 },
    Super,
    Collapse,
    /// The metadata service's abort request: `Permission` for the parent (marks the
    /// superposition written without writing), then `Collapse`, which must reject.
    Abort,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let range = (0..OBJECTS, 0..OBJECT_BYTES / 512, 1..=OBJECT_BYTES / 512).prop_map(|(o, start, n)| {
        let start = start * 512;
        let len = (n * 512).min(OBJECT_BYTES - start);
        (o, start, len)
    });
    prop_oneof![
        4 => (any::<bool>(), range.clone(), 1..=255u8).prop_map(|(child, (objno, offset, len), byte)| Op::Write { child, objno, offset, len, byte }),
        1 => (any::<bool>(), 0..OBJECTS, 1..=255u8).prop_map(|(child, objno, byte)| Op::Write { child, objno, offset: 0, len: OBJECT_BYTES, byte }),
        1 => (any::<bool>(), range.clone()).prop_map(|(child, (objno, offset, len))| Op::Zero { child, objno, offset, len }),
        3 => (any::<bool>(), range).prop_map(|(child, (objno, offset, len))| Op::Read { child, objno, offset, len }),
        1 => Just(Op::Super),
        1 => Just(Op::Collapse),
        1 => Just(Op::Abort),
    ]
}

struct Model {
    vol: VolRef,
    bytes: Vec<u8>,
    child: Option<(VolRef, Vec<u8>)>,
    dirty: bool,
    fenced: Vec<VolId>,
    next_id: VolId,
}

fn run(ops: Vec<Op>) {
    let mut c = Cluster::new();
    let size = (OBJECTS * OBJECT_BYTES as u64) as usize;
    let mut m = Model {
        vol: VolRef { id: 1, table: TABLE, object_size_bytes: OBJECT_BYTES, parent: None },
        bytes: vec![0; size],
        child: None,
        dirty: false,
        fenced: vec![],
        next_id: 2,
    };
    for op in ops {
        match op {
            Op::Write { child, objno, offset, len, .. } | Op::Zero { child, objno, offset, len } | Op::Read { child, objno, offset, len } => {
                let Some(vol) = (if child { m.child.as_ref().map(|c| c.0.clone()) } else { Some(m.vol.clone()) }) else { continue };
                let at = (objno * OBJECT_BYTES as u64) as usize + offset as usize;
                let io = match &op {
                    Op::Write { byte, .. } => IoOp::Write { offset, data: vec![*byte; len as usize] },
                    Op::Zero { .. } => IoOp::Zero { offset, len },
                    _ => IoOp::Read { offset, len },
                };
                let r = c.io(&vol, objno, io);
                let target = if child { &mut m.child.as_mut().unwrap().1 } else { &mut m.bytes };
                match &op {
                    // A child whose parent wrote since super may see those writes (§4.2.1): it
                    // is never promoted, so its reads are not checked.
                    Op::Read { .. } if child && m.dirty => assert!(matches!(r, Ok(ReplyBody::Data(_)))),
                    Op::Read { .. } => {
                        assert_eq!(r, Ok(ReplyBody::Data(target[at..at + len as usize].to_vec())), "read {op:?}");
                    }
                    _ => {
                        assert_eq!(r, Ok(ReplyBody::Done), "{op:?}");
                        let fill = if let Op::Write { byte, .. } = op { byte } else { 0 };
                        target[at..at + len as usize].fill(fill);
                        if !child && m.child.is_some() {
                            // Collocated clones are not isolated from parent writes to objects
                            // the child has not copied (§4.2.1): the child is then never promoted,
                            // so its content no longer matters. Stop checking it.
                            m.dirty = true;
                        }
                    }
                }
            }
            Op::Super => {
                if m.child.is_some() {
                    continue;
                }
                let child = VolRef { id: m.next_id, table: TABLE, object_size_bytes: OBJECT_BYTES, parent: Some(m.vol.id) };
                m.next_id += 1;
                let (p, ch) = (m.vol.id, child.id);
                assert_eq!(c.tracking(|req, epoch| Msg::Super { req, epoch, table: TABLE, parent: p, child: ch }), Ok(ReplyBody::Done));
                m.child = Some((child, m.bytes.clone()));
                m.dirty = false;
            }
            Op::Collapse | Op::Abort => {
                let Some((child, child_bytes)) = m.child.take() else {
                    let id = m.vol.id;
                    let r = c.tracking(|req, epoch| Msg::Collapse { req, epoch, table: TABLE, child: id });
                    assert!(matches!(r, Err(IoErr::CollapseRefused(_))), "collapse of a non-child: {r:?}");
                    continue;
                };
                let parent = m.vol.id;
                if matches!(op, Op::Abort) {
                    let r = c.tracking(|req, epoch| Msg::Permission { req, epoch, table: TABLE, parent });
                    assert_eq!(r, Ok(ReplyBody::Granted(true)), "abort's mark of a live superposition");
                    m.dirty = true;
                }
                let r = c.tracking(|req, epoch| Msg::Collapse { req, epoch, table: TABLE, child: child.id });
                let expect = if m.dirty { CollapseOutcome::Rejected } else { CollapseOutcome::Promoted };
                assert_eq!(r, Ok(ReplyBody::Collapse(expect)));
                let promoted = expect == CollapseOutcome::Promoted;
                if promoted {
                    // A parent write now fails, before and after garbage collection.
                    let r = c.io(&m.vol, 0, IoOp::Write { offset: 0, data: vec![1; 512] });
                    assert!(matches!(r, Err(IoErr::WriteRefused(_))), "fenced parent write: {r:?}");
                }
                c.all(|req, epoch| Msg::Gc { req, epoch, table: TABLE, parent, child: child.id, promoted });
                assert_eq!(c.tracking(|req, epoch| Msg::EndSuper { req, epoch, table: TABLE, child: child.id }), Ok(ReplyBody::Done));
                if promoted {
                    m.fenced.push(parent);
                    assert_eq!(c.objects_of(parent), 0, "parent objects left after GC");
                    m.vol = VolRef { parent: None, ..child };
                    m.bytes = child_bytes;
                } else {
                    assert_eq!(c.objects_of(child.id), 0, "child objects left after GC");
                    // The parent kept permission to write (checked again by the final read).
                    let r = c.io(&m.vol, 0, IoOp::Write { offset: 0, data: vec![7; 512] });
                    assert_eq!(r, Ok(ReplyBody::Done), "a parent write after a rejected collapse or an abort");
                    m.bytes[..512].fill(7);
                }
                // Every object of the surviving volume is on exactly its three shards.
                let n = c.objects_of(m.vol.id);
                assert_eq!(n % 3, 0, "objects of the volume not 3-way replicated: {n}");
            }
        }
    }
    // Final full read of the volume.
    for objno in 0..OBJECTS {
        let r = c.io(&m.vol, objno, IoOp::Read { offset: 0, len: OBJECT_BYTES });
        let at = (objno * OBJECT_BYTES as u64) as usize;
        assert_eq!(r, Ok(ReplyBody::Data(m.bytes[at..at + OBJECT_BYTES as usize].to_vec())), "final read of object {objno}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn parent_and_child_io_match_the_model(ops in proptest::collection::vec(op_strategy(), 1..60)) {
        run(ops);
    }
}
