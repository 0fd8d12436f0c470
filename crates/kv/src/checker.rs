//! A linearizability checker for key-value histories, in the style of Knossos / Porcupine: the
//! Wing & Gong search with Lowe's memoisation of (linearized set, register value) states, run per
//! key (linearizability is compositional, so a map of registers is checked key by key).
//!
//! An operation that never returned (client timeout, node crash) is *pending*: a pending write
//! may or may not have taken effect, at any time after its call; a pending read constrains
//! nothing and is dropped.

use std::collections::{BTreeMap, HashSet};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpKind {
    Put(Vec<u8>),
    /// The value read (`None`: the key did not exist).
    Get(Option<Vec<u8>>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Op {
    pub client: u64,
    pub key: Vec<u8>,
    pub call_us: u64,
    /// `None`: no answer was seen.
    pub ret_us: Option<u64>,
    pub kind: OpKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub key: Vec<u8>,
    pub ops: usize,
    pub detail: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "history of key {:?} ({} ops) is not linearizable: {}",
            String::from_utf8_lossy(&self.key),
            self.ops,
            self.detail
        )
    }
}

/// Search-state budget per key; past it the check gives up with an error rather than hang.
pub const MAX_STATES_PER_KEY: usize = 5_000_000;

/// Checks a whole history (any number of keys).
pub fn check(history: &[Op]) -> Result<(), Violation> {
    let mut by_key: BTreeMap<&[u8], Vec<&Op>> = BTreeMap::new();
    for op in history {
        by_key.entry(&op.key).or_default().push(op);
    }
    for (key, ops) in by_key {
        check_register(key, &ops)?;
    }
    Ok(())
}

struct Search<'a> {
    ops: Vec<&'a Op>,
    /// Value index per op (puts) / expected value index (gets); 0 = absent.
    val: Vec<u32>,
    seen: HashSet<(Vec<u64>, u32)>,
    completed: usize,
}

fn check_register(key: &[u8], ops: &[&Op]) -> Result<(), Violation> {
    let mut ops: Vec<&Op> = ops
        .iter()
        .copied()
        .filter(|o| o.ret_us.is_some() || matches!(o.kind, OpKind::Put(_)))
        .collect();
    ops.sort_by_key(|o| (o.call_us, o.ret_us));
    let mut values: BTreeMap<&[u8], u32> = BTreeMap::new();
    let mut val = Vec::with_capacity(ops.len());
    for o in &ops {
        let v = match &o.kind {
            OpKind::Put(v) | OpKind::Get(Some(v)) => {
                let next = values.len() as u32 + 1;
                *values.entry(v.as_slice()).or_insert(next)
            }
            OpKind::Get(None) => 0,
        };
        val.push(v);
    }
    let completed = ops.iter().filter(|o| o.ret_us.is_some()).count();
    let n = ops.len();
    let mut s = Search {
        ops,
        val,
        seen: HashSet::new(),
        completed,
    };
    let mut done = vec![0u64; n.div_ceil(64)];
    match s.dfs(&mut done, 0, 0) {
        Some(true) => Ok(()),
        Some(false) => Err(Violation {
            key: key.to_vec(),
            ops: n,
            detail: "no order of the operations respects both real time and register semantics"
                .into(),
        }),
        None => Err(Violation {
            key: key.to_vec(),
            ops: n,
            detail: format!("search gave up after {MAX_STATES_PER_KEY} states"),
        }),
    }
}

impl Search<'_> {
    /// `done`: bitset of linearized ops; `value`: register value; `ndone`: completed ops done.
    fn dfs(&mut self, done: &mut Vec<u64>, value: u32, ndone: usize) -> Option<bool> {
        if ndone == self.completed {
            return Some(true);
        }
        if !self.seen.insert((done.clone(), value)) {
            return Some(false);
        }
        if self.seen.len() > MAX_STATES_PER_KEY {
            return None;
        }
        let n = self.ops.len();
        // The earliest return among remaining completed ops bounds which op may go next.
        let mut min_ret = u64::MAX;
        for i in 0..n {
            if done[i / 64] & (1 << (i % 64)) == 0 {
                if let Some(r) = self.ops[i].ret_us {
                    min_ret = min_ret.min(r);
                }
            }
        }
        for i in 0..n {
            if done[i / 64] & (1 << (i % 64)) != 0 {
                continue;
            }
            let o = self.ops[i];
            if o.call_us > min_ret {
                break; // sorted by call: nothing later can go first either
            }
            let next_value = match o.kind {
                OpKind::Put(_) => self.val[i],
                OpKind::Get(_) => {
                    if self.val[i] != value {
                        continue;
                    }
                    value
                }
            };
            done[i / 64] |= 1 << (i % 64);
            let inc = usize::from(o.ret_us.is_some());
            let r = self.dfs(done, next_value, ndone + inc);
            done[i / 64] &= !(1 << (i % 64));
            match r {
                Some(true) => return Some(true),
                None => return None,
                Some(false) => {}
            }
        }
        Some(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(c: u64, call: u64, ret: Option<u64>, v: &str) -> Op {
        Op {
            client: c,
            key: b"k".to_vec(),
            call_us: call,
            ret_us: ret,
            kind: OpKind::Put(v.into()),
        }
    }
    fn get(c: u64, call: u64, ret: u64, v: Option<&str>) -> Op {
        Op {
            client: c,
            key: b"k".to_vec(),
            call_us: call,
            ret_us: Some(ret),
            kind: OpKind::Get(v.map(|s| s.as_bytes().to_vec())),
        }
    }

    #[test]
    fn accepts_sequential_and_concurrent_histories() {
        let h = vec![
            get(1, 0, 1, None),
            put(1, 2, Some(3), "a"),
            get(2, 4, 5, Some("a")),
        ];
        check(&h).unwrap();
        // A read concurrent with a write may see either value.
        let h = vec![
            put(1, 0, Some(10), "a"),
            get(2, 1, 2, Some("a")),
            get(3, 3, 4, Some("a")),
        ];
        check(&h).unwrap();
        let h = vec![
            put(1, 0, Some(10), "a"),
            get(2, 1, 2, None),
            get(3, 3, 4, Some("a")),
        ];
        check(&h).unwrap();
    }

    #[test]
    fn rejects_stale_read_after_acknowledged_write() {
        let h = vec![
            put(1, 0, Some(1), "a"),
            put(1, 2, Some(3), "b"),
            get(2, 4, 5, Some("a")),
        ];
        assert!(check(&h).is_err());
    }

    #[test]
    fn rejects_flip_flop_between_concurrent_writes() {
        // Once a reader saw b then a, no later reader may see b again.
        let h = vec![
            put(1, 0, Some(100), "a"),
            put(2, 0, Some(100), "b"),
            get(3, 10, 11, Some("b")),
            get(3, 12, 13, Some("a")),
            get(4, 14, 15, Some("b")),
        ];
        assert!(check(&h).is_err());
    }

    #[test]
    fn lost_durable_write_is_rejected_and_pending_write_is_optional() {
        // An acknowledged write that later vanishes.
        let h = vec![put(1, 0, Some(1), "a"), get(2, 5, 6, None)];
        assert!(check(&h).is_err());
        // A write that never returned may be seen or not.
        let h = vec![
            put(1, 0, None, "a"),
            get(2, 5, 6, None),
            get(2, 7, 8, Some("a")),
        ];
        check(&h).unwrap();
        let h = vec![
            put(1, 0, None, "a"),
            get(2, 5, 6, Some("a")),
            get(2, 7, 8, None),
        ];
        assert!(check(&h).is_err());
    }
}
