//! The store's values, compares and operations, as etcd defines them (so the embedded backend,
//! which evaluates them itself in [`Compare::holds`], means the same).

use serde::{Deserialize, Serialize};

/// An etcd lease id (the embedded backend numbers its own).
pub type LeaseId = i64;

/// One key as read: its value and etcd's revisions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    /// The store revision that created this key (since its last delete).
    pub create_revision: i64,
    /// The store revision of its last write.
    pub mod_revision: i64,
    /// Writes since its creation (1 after the create).
    pub version: i64,
    /// The lease it is attached to, 0 for none.
    pub lease: LeaseId,
}

/// What a compare looks at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// The mod revision (0 when the key is absent).
    ModRevision(i64),
    /// The create revision (0 when absent: `CreateRevision(0)` with `Equal` means "absent").
    CreateRevision(i64),
    /// The version (0 when absent).
    Version(i64),
    /// The value (an absent key fails every value compare, as on etcd).
    Value(Vec<u8>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmp {
    Equal,
    NotEqual,
    Less,
    Greater,
}

/// One guard of a transaction: `key`'s `target` compared by `cmp`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compare {
    pub key: String,
    pub cmp: Cmp,
    pub target: Target,
}

impl Compare {
    /// `key` does not exist.
    pub fn absent(key: &str) -> Compare {
        Compare { key: key.to_string(), cmp: Cmp::Equal, target: Target::CreateRevision(0) }
    }
    /// `key` was last written at `rev` (0: absent) — "nothing changed since I read it".
    pub fn mod_revision(key: &str, rev: i64) -> Compare {
        Compare { key: key.to_string(), cmp: Cmp::Equal, target: Target::ModRevision(rev) }
    }
    /// `key` exists and was created at `rev`.
    pub fn create_revision(key: &str, rev: i64) -> Compare {
        Compare { key: key.to_string(), cmp: Cmp::Equal, target: Target::CreateRevision(rev) }
    }
    /// `key` holds exactly `value` (an epoch, say).
    pub fn value(key: &str, value: impl Into<Vec<u8>>) -> Compare {
        Compare { key: key.to_string(), cmp: Cmp::Equal, target: Target::Value(value.into()) }
    }

    /// Whether this compare holds against `current` (None: the key is absent) — etcd's rules.
    pub fn holds(&self, current: Option<&KeyValue>) -> bool {
        use std::cmp::Ordering;
        let ord: Ordering = match (&self.target, current) {
            (Target::ModRevision(r), kv) => kv.map_or(0, |kv| kv.mod_revision).cmp(r),
            (Target::CreateRevision(r), kv) => kv.map_or(0, |kv| kv.create_revision).cmp(r),
            (Target::Version(r), kv) => kv.map_or(0, |kv| kv.version).cmp(r),
            (Target::Value(_), None) => return false,
            (Target::Value(v), Some(kv)) => kv.value.as_slice().cmp(v.as_slice()),
        };
        match self.cmp {
            Cmp::Equal => ord == Ordering::Equal,
            Cmp::NotEqual => ord != Ordering::Equal,
            Cmp::Less => ord == Ordering::Less,
            Cmp::Greater => ord == Ordering::Greater,
        }
    }
}

/// One write of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Writes `key`; `lease` (0: none) ties its life to a lease.
    Put { key: String, value: Vec<u8>, lease: LeaseId },
    Delete { key: String },
}

impl Op {
    pub fn put(key: &str, value: impl Into<Vec<u8>>) -> Op {
        Op::Put { key: key.to_string(), value: value.into(), lease: 0 }
    }
    pub fn put_leased(key: &str, value: impl Into<Vec<u8>>, lease: LeaseId) -> Op {
        Op::Put { key: key.to_string(), value: value.into(), lease }
    }
    pub fn delete(key: &str) -> Op {
        Op::Delete { key: key.to_string() }
    }
}

/// What a transaction did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxnOutcome {
    /// Whether every compare held (and the operations were applied).
    pub succeeded: bool,
    /// The store's revision after the transaction.
    pub revision: i64,
    /// On failure, the key the caller asked to read in the same step, if it exists.
    pub(crate) failure_read: Option<KeyValue>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(create: i64, m: i64, value: &[u8]) -> KeyValue {
        KeyValue { key: "/k".into(), value: value.to_vec(), create_revision: create, mod_revision: m, version: 1, lease: 0 }
    }

    #[test]
    fn compares_follow_etcd() {
        assert!(Compare::absent("/k").holds(None));
        assert!(!Compare::absent("/k").holds(Some(&kv(3, 3, b"x"))));
        assert!(Compare::mod_revision("/k", 0).holds(None));
        assert!(Compare::mod_revision("/k", 5).holds(Some(&kv(3, 5, b"x"))));
        assert!(!Compare::mod_revision("/k", 4).holds(Some(&kv(3, 5, b"x"))));
        assert!(!Compare::value("/k", b"x".to_vec()).holds(None));
        assert!(Compare::value("/k", b"x".to_vec()).holds(Some(&kv(3, 5, b"x"))));
        let less = Compare { key: "/k".into(), cmp: Cmp::Less, target: Target::ModRevision(6) };
        assert!(less.holds(Some(&kv(3, 5, b"x"))));
        assert!(!less.holds(Some(&kv(3, 6, b"x"))));
        let ne = Compare { key: "/k".into(), cmp: Cmp::NotEqual, target: Target::Value(b"y".to_vec()) };
        assert!(ne.holds(Some(&kv(3, 5, b"x"))));
        assert!(!ne.holds(None));
    }
}
