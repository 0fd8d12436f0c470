//! Workloads: YCSB's core workloads A–F and a TAO-like social-graph mix, and the deterministic
//! generator that turns one into a stream of operations.

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::choosers::{KeyChooser, RequestDistribution, Uniform, Zipfian, DEFAULT_THETA};
use crate::keys::KeyFormat;
use crate::value::MIN_VALUE_BYTES;
use crate::ConfigError;

/// Shares of each YCSB operation (YCSB's `*proportion` properties); they must sum to 1.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct Proportions {
    pub read: f64,
    pub update: f64,
    pub insert: f64,
    pub scan: f64,
    pub read_modify_write: f64,
}

/// How scan lengths are drawn from `min_scan_length..=max_scan_length` (YCSB's
/// `scanlengthdistribution`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanLengthDistribution {
    Uniform,
    /// Zipfian (θ 0.99) with the shortest scan the most likely.
    Zipfian,
}

/// A TAO-like social-graph mix over objects and association lists.
///
/// TAO's data model (Bronson et al., ATC'13), which TAOBench (Cheng et al., VLDB'22) models:
/// *objects* (a node: id → data) and *associations* (edges `(id1, type, id2)`), read mostly as
/// association lists of one `(id1, type)`. Mapped onto a key-value store:
///
/// - each object id `k` has an object record (`obj<k>`) and one association list record
///   (`assoc:obj<k>`), a fixed-size value of `assoc_list_bytes`;
/// - reads (`read_fraction`, 80 % by default, the TAOBench setting HEAL's §IX uses): `obj_get`
///   reads an object; `assoc_range`, `assoc_get`, `assoc_count` read an association list;
/// - writes: `obj_update` rewrites an object, `obj_add` inserts a new object, `assoc_add` and
///   `assoc_del` read-modify-write an association list (the way a KV store without lists
///   changes one).
///
/// The split within reads and within writes follows TAO's published operation mix as we recall
/// it from the TAO paper — reads: obj_get 28.9 %, assoc_range 40.9 % (+2.8 % time-range,
/// folded in), assoc_get 15.7 %, assoc_count 11.7 %; writes: assoc_add 52.5 % (+0.9 %
/// change-type), assoc_del 8.3 %, obj_add 16.5 %, obj_update 20.7 % (+2.0 % obj_delete, as
/// the trait has no delete) — normalised; the TAOBench configurations themselves (per-request
/// fan-out, transactions, hot-key skew) were not available here and are not modelled.
/// Keys are drawn with the workload's request distribution (uniform by default, as in HEAL).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TaoMix {
    pub read_fraction: f64,
    pub assoc_list_bytes: usize,
}

impl Default for TaoMix {
    fn default() -> Self {
        TaoMix {
            read_fraction: 0.8,
            assoc_list_bytes: 256,
        }
    }
}

/// TAO read operations and their shares of all reads.
const TAO_READS: [(TaoOp, f64); 4] = [
    (TaoOp::ObjGet, 28.9),
    (TaoOp::AssocRange, 40.9 + 2.8),
    (TaoOp::AssocGet, 15.7),
    (TaoOp::AssocCount, 11.7),
];
/// TAO write operations and their shares of all writes.
const TAO_WRITES: [(TaoOp, f64); 4] = [
    (TaoOp::AssocAdd, 52.5 + 0.9),
    (TaoOp::AssocDel, 8.3),
    (TaoOp::ObjAdd, 16.5),
    (TaoOp::ObjUpdate, 20.7 + 2.0),
];

/// Prefix of TAO association list keys, before the object's key.
const TAO_ASSOC_PREFIX: &str = "assoc:";

/// The operation mix of a workload.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mix {
    Ycsb(Proportions),
    Tao(TaoMix),
}

/// A workload: which operations, on which keys, with how much data.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadSpec {
    /// `a`..`f` or `tao` (or anything for a custom mix).
    pub name: String,
    pub mix: Mix,
    pub request_distribution: RequestDistribution,
    /// Records inserted by the load phase (YCSB's `recordcount`).
    pub record_count: u64,
    /// Operations of the run phase (YCSB's `operationcount`); `None` when only a duration
    /// bounds the run (then zipfian choosers expect no inserts).
    pub operation_count: Option<u64>,
    /// A record's value is `field_count * field_length_bytes` bytes (YCSB: 10 × 100). Targets
    /// store a record as one value, so an update writes the whole record (YCSB's
    /// `writeallfields=true`; its default rewrites one field of a record stored field by
    /// field) and a read returns all fields (`readallfields=true`, YCSB's default). Field
    /// lengths are constant (YCSB's default `fieldlengthdistribution`).
    pub field_count: usize,
    pub field_length_bytes: usize,
    pub key_format: KeyFormat,
    pub min_scan_length: u64,
    pub max_scan_length: u64,
    pub scan_length_distribution: ScanLengthDistribution,
}

impl WorkloadSpec {
    /// YCSB's core workload `letter` (`a`..`f`), with the properties of its
    /// `workloads/workload<letter>` file on top of `CoreWorkload`'s defaults: 1000 records,
    /// 1000 operations, 10 fields of 100 bytes, hashed insert order, scans of 1..=1000
    /// (1..=100 for E) records of uniform length.
    pub fn core(letter: &str) -> Result<WorkloadSpec, ConfigError> {
        let zipfian = RequestDistribution::ScrambledZipfian {
            theta: DEFAULT_THETA,
        };
        let (p, distribution, max_scan) = match letter.to_ascii_lowercase().as_str() {
            // Update heavy: session store recording recent actions.
            "a" => (
                Proportions {
                    read: 0.5,
                    update: 0.5,
                    ..Default::default()
                },
                zipfian,
                1000,
            ),
            // Read mostly: photo tagging.
            "b" => (
                Proportions {
                    read: 0.95,
                    update: 0.05,
                    ..Default::default()
                },
                zipfian,
                1000,
            ),
            // Read only: user profile cache.
            "c" => (
                Proportions {
                    read: 1.0,
                    ..Default::default()
                },
                zipfian,
                1000,
            ),
            // Read latest: user status updates.
            "d" => (
                Proportions {
                    read: 0.95,
                    insert: 0.05,
                    ..Default::default()
                },
                RequestDistribution::Latest {
                    theta: DEFAULT_THETA,
                },
                1000,
            ),
            // Short ranges: threaded conversations.
            "e" => (
                Proportions {
                    scan: 0.95,
                    insert: 0.05,
                    ..Default::default()
                },
                zipfian,
                100,
            ),
            // Read-modify-write: user database.
            "f" => (
                Proportions {
                    read: 0.5,
                    read_modify_write: 0.5,
                    ..Default::default()
                },
                zipfian,
                1000,
            ),
            other => {
                return Err(ConfigError::new(format!(
                    "unknown YCSB workload {other:?}: use a, b, c, d, e or f (or tao)"
                )))
            }
        };
        Ok(WorkloadSpec {
            name: letter.to_ascii_lowercase(),
            mix: Mix::Ycsb(p),
            request_distribution: distribution,
            record_count: 1000,
            operation_count: Some(1000),
            field_count: 10,
            field_length_bytes: 100,
            key_format: KeyFormat::default(),
            min_scan_length: 1,
            max_scan_length: max_scan,
            scan_length_distribution: ScanLengthDistribution::Uniform,
        })
    }

    /// The TAO-like social-graph mix (see [`TaoMix`]), uniform keys.
    pub fn tao() -> WorkloadSpec {
        WorkloadSpec {
            name: "tao".to_string(),
            mix: Mix::Tao(TaoMix::default()),
            request_distribution: RequestDistribution::Uniform,
            record_count: 1000,
            operation_count: Some(1000),
            field_count: 10,
            field_length_bytes: 100,
            key_format: KeyFormat {
                prefix: "obj".to_string(),
                ..KeyFormat::default()
            },
            min_scan_length: 1,
            max_scan_length: 1000,
            scan_length_distribution: ScanLengthDistribution::Uniform,
        }
    }

    /// `a`..`f` or `tao`.
    pub fn by_name(name: &str) -> Result<WorkloadSpec, ConfigError> {
        if name.eq_ignore_ascii_case("tao") {
            Ok(WorkloadSpec::tao())
        } else {
            WorkloadSpec::core(name)
        }
    }

    /// Bytes of one record's value.
    pub fn value_size_bytes(&self) -> usize {
        self.field_count.saturating_mul(self.field_length_bytes)
    }

    /// Whether the run phase issues scans (the target must support them).
    pub fn has_scans(&self) -> bool {
        matches!(self.mix, Mix::Ycsb(p) if p.scan > 0.0)
    }

    /// Inserts the run phase is expected to make (sizes the zipfian key space, as YCSB does).
    pub fn expected_inserts(&self) -> u64 {
        let share = match self.mix {
            Mix::Ycsb(p) => p.insert,
            Mix::Tao(t) => (1.0 - t.read_fraction) * share_of(&TAO_WRITES, TaoOp::ObjAdd),
        };
        self.operation_count
            .map_or(0, |ops| (ops as f64 * share).ceil() as u64)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        self.key_format.validate()?;
        if self.record_count == 0 {
            return Err(ConfigError::new("the record count must be at least 1"));
        }
        // Checks θ and the like: building a chooser is O(1).
        KeyChooser::new(self.request_distribution, self.record_count, 0)?;
        if self.record_count > self.key_format.capacity() {
            return Err(ConfigError::new(format!(
                "{} records do not fit in keys of {} bytes (at most {}); use longer keys",
                self.record_count,
                self.key_format.key_size_bytes.unwrap_or(0),
                self.key_format.capacity()
            )));
        }
        if self.value_size_bytes() < MIN_VALUE_BYTES {
            return Err(ConfigError::new(format!(
                "values of {} fields × {} bytes are shorter than the {MIN_VALUE_BYTES} bytes \
                 every value needs to be checked on read; use at least {MIN_VALUE_BYTES} bytes",
                self.field_count, self.field_length_bytes
            )));
        }
        match self.mix {
            Mix::Ycsb(p) => {
                let shares = [p.read, p.update, p.insert, p.scan, p.read_modify_write];
                if shares.iter().any(|s| !(s.is_finite() && *s >= 0.0)) {
                    return Err(ConfigError::new(format!(
                        "operation proportions must be finite and not negative: {p:?}"
                    )));
                }
                let sum: f64 = shares.iter().sum();
                if (sum - 1.0).abs() > 1e-9 {
                    return Err(ConfigError::new(format!(
                        "operation proportions sum to {sum}, not 1: {p:?}"
                    )));
                }
            }
            Mix::Tao(t) => {
                if !(0.0..=1.0).contains(&t.read_fraction) {
                    return Err(ConfigError::new(format!(
                        "TAO read fraction {}: must be between 0 and 1",
                        t.read_fraction
                    )));
                }
                if t.assoc_list_bytes < MIN_VALUE_BYTES {
                    return Err(ConfigError::new(format!(
                        "association lists of {} bytes are shorter than the \
                         {MIN_VALUE_BYTES} bytes every checked value needs",
                        t.assoc_list_bytes
                    )));
                }
            }
        }
        if self.has_scans()
            && (self.min_scan_length == 0 || self.min_scan_length > self.max_scan_length)
        {
            return Err(ConfigError::new(format!(
                "scan lengths {}..={}: need 1 <= min <= max",
                self.min_scan_length, self.max_scan_length
            )));
        }
        Ok(())
    }
}

fn share_of(table: &[(TaoOp, f64)], op: TaoOp) -> f64 {
    let total: f64 = table.iter().map(|(_, w)| w).sum();
    table
        .iter()
        .filter(|(o, _)| *o == op)
        .map(|(_, w)| w)
        .sum::<f64>()
        / total
}

/// What an operation does to the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    Read,
    Update,
    Insert,
    Scan,
    ReadModifyWrite,
}

/// One operation to issue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Op {
    /// Name in reports: `read`, `update`, `insert`, `scan`, `read_modify_write`, or a TAO
    /// operation (`obj_get`, `assoc_range`, ...).
    pub label: &'static str,
    pub kind: OpKind,
    /// The key number the key was made from (for inserts: to acknowledge).
    pub keynum: u64,
    pub key: Vec<u8>,
    /// Records to scan (scans only).
    pub scan_length: u64,
    /// Nonce of the value to write (writes only).
    pub nonce: u64,
    /// Length of the value to write.
    pub value_bytes: usize,
    /// The key may legitimately be absent (a TAO association list of an object added during
    /// the run): a miss is not a lost record.
    pub absent_ok: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TaoOp {
    ObjGet,
    AssocRange,
    AssocGet,
    AssocCount,
    AssocAdd,
    AssocDel,
    ObjAdd,
    ObjUpdate,
}

#[derive(Clone, Copy, Debug)]
enum Template {
    Ycsb(OpKind),
    Tao(TaoOp),
}

/// YCSB's acknowledged counter: hands out key numbers for inserts and tracks the newest key
/// number below which every insert has completed ([`InsertSequence::last`]), so that no read is
/// sent to a key whose insert is still in flight. Shared by all clients of a run; holds at
/// most one pending entry per insert in flight.
#[derive(Debug)]
pub struct InsertSequence {
    state: Mutex<SequenceState>,
}

#[derive(Debug)]
struct SequenceState {
    next: u64,
    last: u64,
    done_out_of_order: BTreeSet<u64>,
    /// Inserts that failed: their keys may be absent. Bounded by the runner's error limit.
    failed: HashSet<u64>,
}

impl InsertSequence {
    /// A sequence after `loaded` records (key numbers `0..loaded`) have been loaded.
    pub fn new(loaded: u64) -> InsertSequence {
        assert!(loaded >= 1, "at least one record is loaded");
        InsertSequence {
            state: Mutex::new(SequenceState {
                next: loaded,
                last: loaded - 1,
                done_out_of_order: BTreeSet::new(),
                failed: HashSet::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SequenceState> {
        // A panicking client cannot leave the counters half-updated: every update is one step.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The key number for the next insert.
    pub fn next_insert(&self) -> u64 {
        let mut s = self.lock();
        let k = s.next;
        s.next += 1;
        k
    }

    /// The newest key number such that every insert up to it has completed.
    pub fn last(&self) -> u64 {
        self.lock().last
    }

    /// Marks the insert of `keynum` complete (`ok = false`: it failed, the key may be absent).
    /// Like YCSB, a failed insert is acknowledged too, so that "latest" keeps moving.
    pub fn acknowledge(&self, keynum: u64, ok: bool) {
        let mut s = self.lock();
        if !ok {
            s.failed.insert(keynum);
        }
        s.done_out_of_order.insert(keynum);
        loop {
            let following = s.last + 1;
            if !s.done_out_of_order.remove(&following) {
                break;
            }
            s.last = following;
        }
    }

    /// Whether the insert of `keynum` failed.
    pub fn failed(&self, keynum: u64) -> bool {
        self.lock().failed.contains(&keynum)
    }
}

#[derive(Clone, Debug)]
enum ScanLength {
    Uniform(Uniform),
    Zipfian { min: u64, ranks: Zipfian },
}

/// The deterministic core of one client: given a seed, the same sequence of operations (and,
/// for inserts, of key numbers drawn from the shared [`InsertSequence`]).
#[derive(Clone, Debug)]
pub struct OpGenerator {
    spec: Arc<WorkloadSpec>,
    rng: ChaCha8Rng,
    chooser: KeyChooser,
    scan_length: ScanLength,
    /// Cumulative weights of the templates, for one uniform draw per operation.
    templates: Vec<(f64, Template)>,
}

impl OpGenerator {
    pub fn new(spec: Arc<WorkloadSpec>, seed: u64) -> Result<OpGenerator, ConfigError> {
        spec.validate()?;
        let chooser = KeyChooser::new(
            spec.request_distribution,
            spec.record_count,
            spec.expected_inserts(),
        )?;
        let scan_length = match spec.scan_length_distribution {
            _ if !spec.has_scans() => ScanLength::Uniform(Uniform { lo: 1, hi: 1 }),
            ScanLengthDistribution::Uniform => ScanLength::Uniform(Uniform {
                lo: spec.min_scan_length,
                hi: spec.max_scan_length,
            }),
            ScanLengthDistribution::Zipfian => ScanLength::Zipfian {
                min: spec.min_scan_length,
                ranks: Zipfian::new(
                    spec.max_scan_length - spec.min_scan_length + 1,
                    DEFAULT_THETA,
                )?,
            },
        };
        let weighted: Vec<(f64, Template)> = match spec.mix {
            Mix::Ycsb(p) => vec![
                (p.read, Template::Ycsb(OpKind::Read)),
                (p.update, Template::Ycsb(OpKind::Update)),
                (p.insert, Template::Ycsb(OpKind::Insert)),
                (p.scan, Template::Ycsb(OpKind::Scan)),
                (p.read_modify_write, Template::Ycsb(OpKind::ReadModifyWrite)),
            ],
            Mix::Tao(t) => {
                let reads = TAO_READS
                    .iter()
                    .map(|&(op, _)| (t.read_fraction * share_of(&TAO_READS, op), op));
                let writes = TAO_WRITES
                    .iter()
                    .map(|&(op, _)| ((1.0 - t.read_fraction) * share_of(&TAO_WRITES, op), op));
                reads
                    .chain(writes)
                    .map(|(w, op)| (w, Template::Tao(op)))
                    .collect()
            }
        };
        let mut cumulative = 0.0;
        let templates = weighted
            .into_iter()
            .filter(|(w, _)| *w > 0.0)
            .map(|(w, t)| {
                cumulative += w;
                (cumulative, t)
            })
            .collect();
        Ok(OpGenerator {
            spec,
            rng: ChaCha8Rng::seed_from_u64(seed),
            chooser,
            scan_length,
            templates,
        })
    }

    pub fn spec(&self) -> &WorkloadSpec {
        &self.spec
    }

    fn object_key(&self, keynum: u64) -> Vec<u8> {
        self.spec.key_format.key(keynum)
    }

    fn assoc_key(&self, keynum: u64) -> Vec<u8> {
        let mut key = TAO_ASSOC_PREFIX.as_bytes().to_vec();
        key.extend_from_slice(&self.spec.key_format.key(keynum));
        key
    }

    fn op(&mut self, label: &'static str, kind: OpKind, keynum: u64, key: Vec<u8>) -> Op {
        Op {
            label,
            kind,
            keynum,
            key,
            scan_length: 0,
            nonce: self.rng.gen(),
            value_bytes: self.spec.value_size_bytes(),
            absent_ok: false,
        }
    }

    /// The inserts that load record `keynum` (one for YCSB; an object and its association
    /// list for TAO).
    pub fn load_ops(&mut self, keynum: u64) -> Vec<Op> {
        let key = self.object_key(keynum);
        let mut ops = vec![self.op("insert", OpKind::Insert, keynum, key)];
        if let Mix::Tao(t) = self.spec.mix {
            let key = self.assoc_key(keynum);
            let mut list = self.op("insert", OpKind::Insert, keynum, key);
            list.value_bytes = t.assoc_list_bytes;
            ops.push(list);
        }
        ops
    }

    /// The next operation of the run phase. Inserts take their key number from `sequence`
    /// (the caller acknowledges it when the insert completes); other operations choose among
    /// the keys whose inserts have completed.
    pub fn next_op(&mut self, sequence: &InsertSequence) -> Result<Op, ConfigError> {
        let total = self.templates.last().map_or(0.0, |(c, _)| *c);
        let draw = self.rng.gen::<f64>() * total;
        let template = self
            .templates
            .iter()
            .find(|(c, _)| draw < *c)
            .or(self.templates.last())
            .map(|(_, t)| *t)
            .expect("a validated workload has an operation with a positive share");
        let is_insert = matches!(
            template,
            Template::Ycsb(OpKind::Insert) | Template::Tao(TaoOp::ObjAdd)
        );
        let keynum = if is_insert {
            let k = sequence.next_insert();
            if k >= self.spec.key_format.capacity() {
                sequence.acknowledge(k, false);
                return Err(ConfigError::new(format!(
                    "the key space is full: keys of {:?} bytes name at most {} records; use \
                     longer keys",
                    self.spec.key_format.key_size_bytes,
                    self.spec.key_format.capacity()
                )));
            }
            k
        } else {
            self.chooser.next(&mut self.rng, sequence.last())
        };
        let loaded = keynum < self.spec.record_count;
        let op = match template {
            Template::Ycsb(kind) => {
                let label = match kind {
                    OpKind::Read => "read",
                    OpKind::Update => "update",
                    OpKind::Insert => "insert",
                    OpKind::Scan => "scan",
                    OpKind::ReadModifyWrite => "read_modify_write",
                };
                let key = self.object_key(keynum);
                let mut op = self.op(label, kind, keynum, key);
                if kind == OpKind::Scan {
                    op.scan_length = match &self.scan_length {
                        ScanLength::Uniform(u) => u.sample(&mut self.rng),
                        ScanLength::Zipfian { min, ranks } => min + ranks.sample(&mut self.rng) - 1,
                    };
                }
                op
            }
            Template::Tao(tao) => {
                let (label, kind, assoc) = match tao {
                    TaoOp::ObjGet => ("obj_get", OpKind::Read, false),
                    TaoOp::AssocRange => ("assoc_range", OpKind::Read, true),
                    TaoOp::AssocGet => ("assoc_get", OpKind::Read, true),
                    TaoOp::AssocCount => ("assoc_count", OpKind::Read, true),
                    TaoOp::AssocAdd => ("assoc_add", OpKind::ReadModifyWrite, true),
                    TaoOp::AssocDel => ("assoc_del", OpKind::ReadModifyWrite, true),
                    TaoOp::ObjAdd => ("obj_add", OpKind::Insert, false),
                    TaoOp::ObjUpdate => ("obj_update", OpKind::Update, false),
                };
                if assoc {
                    let key = self.assoc_key(keynum);
                    let mut op = self.op(label, kind, keynum, key);
                    if let Mix::Tao(t) = self.spec.mix {
                        op.value_bytes = t.assoc_list_bytes;
                    }
                    // Objects added during the run have no association list yet.
                    op.absent_ok = !loaded;
                    op
                } else {
                    let key = self.object_key(keynum);
                    self.op(label, kind, keynum, key)
                }
            }
        };
        Ok(op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn counts(spec: WorkloadSpec, n: usize) -> BTreeMap<&'static str, usize> {
        let spec = Arc::new(spec);
        let seq = InsertSequence::new(spec.record_count);
        let mut generator = OpGenerator::new(spec, 7).unwrap();
        let mut counts = BTreeMap::new();
        for _ in 0..n {
            let op = generator.next_op(&seq).unwrap();
            if op.kind == OpKind::Insert {
                seq.acknowledge(op.keynum, true);
            }
            *counts.entry(op.label).or_insert(0) += 1;
        }
        counts
    }

    /// Checks that `label` makes up `share` of `n` draws within 5 standard deviations.
    fn assert_share(counts: &BTreeMap<&str, usize>, label: &str, share: f64, n: usize) {
        let got = *counts.get(label).unwrap_or(&0) as f64;
        let expected = share * n as f64;
        let sd = (n as f64 * share * (1.0 - share)).sqrt().max(1.0);
        assert!(
            (got - expected).abs() <= 5.0 * sd,
            "{label}: {got} of {n}, expected {expected} ± {}",
            5.0 * sd
        );
    }

    #[test]
    fn core_workload_mixes() {
        let n = 20_000;
        let table: [(&str, &[(&str, f64)]); 6] = [
            ("a", &[("read", 0.5), ("update", 0.5)]),
            ("b", &[("read", 0.95), ("update", 0.05)]),
            ("c", &[("read", 1.0)]),
            ("d", &[("read", 0.95), ("insert", 0.05)]),
            ("e", &[("scan", 0.95), ("insert", 0.05)]),
            ("f", &[("read", 0.5), ("read_modify_write", 0.5)]),
        ];
        for (letter, shares) in table {
            let c = counts(WorkloadSpec::core(letter).unwrap(), n);
            assert_eq!(c.len(), shares.len(), "{letter}: {c:?}");
            for (label, share) in shares {
                assert_share(&c, label, *share, n);
            }
        }
    }

    #[test]
    fn tao_mix_is_80_20_over_objects_and_lists() {
        let n = 50_000;
        let c = counts(WorkloadSpec::tao(), n);
        let reads: usize = ["obj_get", "assoc_range", "assoc_get", "assoc_count"]
            .iter()
            .map(|l| c[l])
            .sum();
        let share = reads as f64 / n as f64;
        assert!((share - 0.8).abs() < 0.01, "{c:?}");
        assert_share(&c, "obj_add", 0.2 * share_of(&TAO_WRITES, TaoOp::ObjAdd), n);
        assert_share(&c, "obj_get", 0.8 * share_of(&TAO_READS, TaoOp::ObjGet), n);
    }

    #[test]
    fn workload_e_scan_lengths_are_uniform_up_to_100() {
        let spec = Arc::new(WorkloadSpec::core("e").unwrap());
        let seq = InsertSequence::new(spec.record_count);
        let mut generator = OpGenerator::new(spec, 1).unwrap();
        let mut lengths = vec![0usize; 101];
        for _ in 0..50_000 {
            let op = generator.next_op(&seq).unwrap();
            if op.kind == OpKind::Scan {
                lengths[op.scan_length as usize] += 1;
            } else {
                seq.acknowledge(op.keynum, true);
            }
        }
        assert_eq!(lengths[0], 0);
        let scans: usize = lengths.iter().sum();
        // Every length 1..=100 near 1 % of scans.
        for (len, &c) in lengths.iter().enumerate().skip(1) {
            let expected = scans as f64 / 100.0;
            assert!(
                (c as f64 - expected).abs() < 5.0 * expected.sqrt(),
                "length {len}: {c}"
            );
        }
    }

    #[test]
    fn reads_never_reach_inserts_in_flight() {
        let spec = Arc::new(WorkloadSpec::core("d").unwrap());
        let seq = InsertSequence::new(spec.record_count);
        let mut generator = OpGenerator::new(spec, 3).unwrap();
        let mut pending = vec![];
        for i in 0..20_000 {
            let op = generator.next_op(&seq).unwrap();
            match op.kind {
                OpKind::Insert => pending.push(op.keynum),
                _ => assert!(op.keynum <= seq.last()),
            }
            // Complete inserts out of order, some late.
            if i % 7 == 0 && !pending.is_empty() {
                let k = pending.swap_remove(i % pending.len());
                seq.acknowledge(k, true);
            }
        }
        for k in pending {
            seq.acknowledge(k, true);
        }
        assert_eq!(seq.last(), seq.next_insert() - 1);
    }

    #[test]
    fn same_seed_same_ops() {
        let run = |seed| {
            let spec = Arc::new(WorkloadSpec::core("a").unwrap());
            let seq = InsertSequence::new(spec.record_count);
            let mut g = OpGenerator::new(spec, seed).unwrap();
            (0..100)
                .map(|_| g.next_op(&seq).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn bad_specs_are_refused_with_reasons() {
        let mut spec = WorkloadSpec::core("a").unwrap();
        spec.field_length_bytes = 1;
        assert!(spec.validate().unwrap_err().0.contains("checked on read"));
        let mut spec = WorkloadSpec::core("a").unwrap();
        spec.mix = Mix::Ycsb(Proportions {
            read: 0.7,
            ..Default::default()
        });
        assert!(spec.validate().unwrap_err().0.contains("sum to"));
        assert!(WorkloadSpec::core("z").is_err());
        let mut spec = WorkloadSpec::core("a").unwrap();
        spec.key_format.key_size_bytes = Some(6); // 100 keys
        assert!(spec.validate().unwrap_err().0.contains("do not fit"));
    }
}
