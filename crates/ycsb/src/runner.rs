//! The closed-loop runner: N clients, each with one operation in flight, as tokio tasks.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bench::{WindowedCounter, WindowedLatency};

use crate::summary::{OpStats, Phase, PhaseSummary, PROBLEMS_KEPT};
use crate::target::{KvTarget, TargetError};
use crate::value::{check_value, make_value};
use crate::workload::{InsertSequence, Op, OpGenerator, OpKind, WorkloadSpec};
use crate::ConfigError;

/// How a phase runs.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Base seed; client `i` of a phase draws from a seed derived from it, the phase and `i`.
    pub seed: u64,
    /// The run phase stops after this long even if operations remain (`None`: only the
    /// workload's operation count bounds it). The load phase always loads every record.
    pub max_duration: Option<Duration>,
    /// Throughput window (BENCH.md timelines use 100 ms).
    pub window: Duration,
    /// The phase stops with [`RunError::TooManyErrors`] once more operations than this failed
    /// (`u64::MAX`: never, for runs through failures).
    pub max_errors: u64,
    /// Also keep one latency histogram per `window` ([`PhaseSummary::latency_windows`]): the
    /// per-window percentiles that time-to-recovery is judged on. Off by default: each client
    /// holds a histogram per window until the phase ends.
    pub latency_windows: bool,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            seed: 1,
            max_duration: None,
            window: Duration::from_millis(100),
            max_errors: 1000,
            latency_windows: false,
        }
    }
}

/// Why a phase stopped early.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("workload: {0}")]
    Config(#[from] ConfigError),
    #[error("{0}")]
    Unsupported(TargetError),
    #[error("{count} operations failed (more than the limit of {limit}); the first: {first}")]
    TooManyErrors {
        count: u64,
        limit: u64,
        first: String,
    },
    #[error("a client task failed: {0}")]
    Client(String),
}

/// Runs the load and run phases of one workload against targets (one per client).
pub struct Runner {
    spec: Arc<WorkloadSpec>,
    sequence: Arc<InsertSequence>,
}

/// State every client of a phase shares.
struct Shared {
    start: Instant,
    deadline: Option<Instant>,
    /// Operations left to claim: load key numbers, or run operations (`u64::MAX`: unbounded).
    next_or_remaining: AtomicU64,
    stop: AtomicBool,
    errors: AtomicU64,
    config: RunConfig,
    sequence: Arc<InsertSequence>,
}

/// One client's measurements, merged into the phase's summary at the end.
struct ClientStats {
    ops: BTreeMap<&'static str, OpStats>,
    windows: WindowedCounter,
    latency_windows: Option<WindowedLatency>,
    missing: u64,
    corrupt: u64,
    errors: u64,
    problems: Vec<String>,
}

impl ClientStats {
    fn new(config: &RunConfig) -> ClientStats {
        let window = config.window;
        ClientStats {
            ops: BTreeMap::new(),
            windows: WindowedCounter::new(window),
            latency_windows: config.latency_windows.then(|| WindowedLatency::new(window)),
            missing: 0,
            corrupt: 0,
            errors: 0,
            problems: vec![],
        }
    }

    fn problem(&mut self, text: impl FnOnce() -> String) {
        if self.problems.len() < PROBLEMS_KEPT {
            self.problems.push(text());
        }
    }
}

/// SplitMix64 of the inputs: independent seeds per phase and client.
fn derive_seed(seed: u64, phase: u64, client: u64) -> u64 {
    let mut z = seed
        ^ phase.wrapping_mul(0xD6E8_FEB8_6659_FD93)
        ^ client.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Runner {
    pub fn new(spec: WorkloadSpec) -> Result<Runner, ConfigError> {
        spec.validate()?;
        let sequence = Arc::new(InsertSequence::new(spec.record_count));
        Ok(Runner {
            spec: Arc::new(spec),
            sequence,
        })
    }

    pub fn spec(&self) -> &WorkloadSpec {
        &self.spec
    }

    /// Inserts the `record_count` records, the clients taking key numbers in turn.
    pub async fn load<T: KvTarget>(
        &self,
        targets: Vec<T>,
        config: &RunConfig,
    ) -> Result<(Vec<T>, PhaseSummary), RunError> {
        self.phase(Phase::Load, targets, config).await
    }

    /// Issues the workload's operations until the operation count is used up or
    /// `config.max_duration` has passed, whichever comes first.
    pub async fn run<T: KvTarget>(
        &self,
        targets: Vec<T>,
        config: &RunConfig,
    ) -> Result<(Vec<T>, PhaseSummary), RunError> {
        if self.spec.operation_count.is_none() && config.max_duration.is_none() {
            return Err(ConfigError::new(
                "the run phase needs an operation count, a duration, or both",
            )
            .into());
        }
        self.phase(Phase::Run, targets, config).await
    }

    async fn phase<T: KvTarget>(
        &self,
        phase: Phase,
        targets: Vec<T>,
        config: &RunConfig,
    ) -> Result<(Vec<T>, PhaseSummary), RunError> {
        if targets.is_empty() {
            return Err(ConfigError::new("at least one client (target) is needed").into());
        }
        let clients = targets.len();
        let start = Instant::now();
        let shared = Arc::new(Shared {
            start,
            deadline: match phase {
                Phase::Load => None,
                Phase::Run => config.max_duration.map(|d| start + d),
            },
            next_or_remaining: AtomicU64::new(match phase {
                Phase::Load => 0,
                Phase::Run => self.spec.operation_count.unwrap_or(u64::MAX),
            }),
            stop: AtomicBool::new(false),
            errors: AtomicU64::new(0),
            config: config.clone(),
            sequence: self.sequence.clone(),
        });
        let phase_number = match phase {
            Phase::Load => 0,
            Phase::Run => 1,
        };
        let mut tasks = Vec::with_capacity(clients);
        for (i, target) in targets.into_iter().enumerate() {
            let generator = OpGenerator::new(
                self.spec.clone(),
                derive_seed(config.seed, phase_number, i as u64),
            )?;
            let shared = shared.clone();
            tasks.push(tokio::spawn(client(phase, target, generator, shared)));
        }
        let mut targets = Vec::with_capacity(clients);
        let mut merged = ClientStats::new(config);
        let mut first_error = None;
        for task in tasks {
            let (target, stats, error) = task.await.map_err(|e| RunError::Client(e.to_string()))?;
            targets.push(target);
            for (label, s) in stats.ops {
                let entry = merged.ops.entry(label).or_default();
                entry.latency.merge(&s.latency);
                entry.errors += s.errors;
            }
            merged.windows.merge(&stats.windows);
            if let (Some(all), Some(mine)) = (&mut merged.latency_windows, &stats.latency_windows) {
                all.merge(mine);
            }
            merged.missing += stats.missing;
            merged.corrupt += stats.corrupt;
            merged.errors += stats.errors;
            for p in stats.problems {
                if merged.problems.len() < PROBLEMS_KEPT {
                    merged.problems.push(p);
                }
            }
            if first_error.is_none() {
                first_error = error;
            }
        }
        let elapsed = start.elapsed();
        if let Some(e) = first_error {
            return Err(e);
        }
        for p in &merged.problems {
            tracing::warn!(phase = phase.name(), "{p}");
        }
        let summary = PhaseSummary {
            phase,
            clients,
            elapsed,
            ops: merged.ops,
            windows: merged.windows,
            latency_windows: merged.latency_windows,
            started: start,
            window: config.window,
            missing_count: merged.missing,
            corrupt_count: merged.corrupt,
            errors_count: merged.errors,
            first_problems: merged.problems,
        };
        Ok((targets, summary))
    }
}

/// Claims the next unit of work: a load key number, or one run operation.
fn claim(phase: Phase, shared: &Shared, record_count: u64) -> Option<u64> {
    if shared.stop.load(Ordering::Relaxed) {
        return None;
    }
    if shared.deadline.is_some_and(|d| Instant::now() >= d) {
        return None;
    }
    match phase {
        Phase::Load => {
            let k = shared.next_or_remaining.fetch_add(1, Ordering::Relaxed);
            (k < record_count).then_some(k)
        }
        Phase::Run => shared
            .next_or_remaining
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| match left {
                0 => None,
                u64::MAX => Some(u64::MAX),
                n => Some(n - 1),
            })
            .ok(),
    }
}

async fn client<T: KvTarget>(
    phase: Phase,
    mut target: T,
    mut generator: OpGenerator,
    shared: Arc<Shared>,
) -> (T, ClientStats, Option<RunError>) {
    let mut stats = ClientStats::new(&shared.config);
    let record_count = generator.spec().record_count;
    while let Some(k) = claim(phase, &shared, record_count) {
        let ops = match phase {
            Phase::Load => generator.load_ops(k),
            Phase::Run => match generator.next_op(&shared.sequence) {
                Ok(op) => vec![op],
                Err(e) => {
                    shared.stop.store(true, Ordering::Relaxed);
                    return (target, stats, Some(e.into()));
                }
            },
        };
        for op in ops {
            if let Err(e) = execute(phase, &mut target, &op, &shared, &mut stats).await {
                shared.stop.store(true, Ordering::Relaxed);
                return (target, stats, Some(e));
            }
        }
    }
    (target, stats, None)
}

/// A key and what reading it returned.
type ReadBack = (Vec<u8>, Option<Vec<u8>>);

/// Whether `value` is what the driver wrote for `key`; the reason if not.
fn check(key: &[u8], value: &[u8], expected_len: usize) -> Result<(), String> {
    check_value(key, value).map_err(|e| e.to_string())?;
    if value.len() != expected_len {
        return Err(format!(
            "value is {} bytes, the driver writes {expected_len}",
            value.len()
        ));
    }
    Ok(())
}

async fn execute<T: KvTarget>(
    phase: Phase,
    target: &mut T,
    op: &Op,
    shared: &Shared,
    stats: &mut ClientStats,
) -> Result<(), RunError> {
    let key_text = || String::from_utf8_lossy(&op.key).into_owned();
    let started = Instant::now();
    // Ok(values read back, with the key each belongs to) or the error.
    let outcome: Result<Vec<ReadBack>, TargetError> = match op.kind {
        OpKind::Read => target.get(&op.key).await.map(|v| vec![(op.key.clone(), v)]),
        OpKind::Update => {
            let value = make_value(&op.key, op.nonce, op.value_bytes);
            target.put(&op.key, &value).await.map(|()| vec![])
        }
        OpKind::Insert => {
            let value = make_value(&op.key, op.nonce, op.value_bytes);
            let result = target.insert(&op.key, &value).await;
            if phase == Phase::Run {
                shared.sequence.acknowledge(op.keynum, result.is_ok());
            }
            result.map(|()| vec![])
        }
        OpKind::ReadModifyWrite => {
            let (key, nonce, len) = (op.key.clone(), op.nonce, op.value_bytes);
            target
                .read_modify_write(&op.key, move |_old| make_value(&key, nonce, len))
                .await
                .map(|old| vec![(op.key.clone(), old)])
        }
        OpKind::Scan => {
            let count = usize::try_from(op.scan_length).unwrap_or(usize::MAX);
            match target.scan(&op.key, count).await {
                Ok(records) => {
                    let in_order = records.windows(2).all(|w| w[0].0 < w[1].0)
                        && records.first().is_none_or(|(k, _)| *k >= op.key);
                    if !in_order || records.len() > count {
                        stats.corrupt += 1;
                        stats.problem(|| {
                            format!(
                                "scan from {} for {count} returned {} records out of order \
                                 or too many",
                                key_text(),
                                records.len()
                            )
                        });
                    }
                    // The start key exists (it was chosen among completed inserts), so it
                    // must come first.
                    let mut checked: Vec<ReadBack> =
                        records.into_iter().map(|(k, v)| (k, Some(v))).collect();
                    if checked.first().is_none_or(|(k, _)| *k != op.key) {
                        checked.insert(0, (op.key.clone(), None));
                    }
                    Ok(checked)
                }
                Err(e) => Err(e),
            }
        }
    };
    let latency = started.elapsed();
    let entry = stats.ops.entry(op.label).or_default();
    match outcome {
        Ok(values) => {
            entry.latency.record(latency);
            let completed = shared.start.elapsed();
            stats.windows.record(completed);
            if let Some(windows) = &mut stats.latency_windows {
                windows.record(completed, latency);
            }
            for (key, value) in values {
                match value {
                    Some(v) => {
                        if let Err(reason) = check(&key, &v, op.value_bytes) {
                            stats.corrupt += 1;
                            let key = String::from_utf8_lossy(&key).into_owned();
                            stats.problem(|| format!("{} of {key}: {reason}", op.label));
                        }
                    }
                    None => {
                        if !op.absent_ok && !shared.sequence.failed(op.keynum) {
                            stats.missing += 1;
                            let key = String::from_utf8_lossy(&key).into_owned();
                            stats.problem(|| {
                                format!("{} of {key}: the record is missing", op.label)
                            });
                        }
                    }
                }
            }
            Ok(())
        }
        Err(e @ TargetError::Unsupported { .. }) => Err(RunError::Unsupported(e)),
        Err(e) => {
            entry.errors += 1;
            stats.errors += 1;
            stats.problem(|| format!("{} of {}: {e}", op.label, key_text()));
            let total = shared.errors.fetch_add(1, Ordering::Relaxed) + 1;
            if total > shared.config.max_errors {
                return Err(RunError::TooManyErrors {
                    count: total,
                    limit: shared.config.max_errors,
                    first: stats
                        .problems
                        .first()
                        .cloned()
                        .unwrap_or_else(|| e.to_string()),
                });
            }
            Ok(())
        }
    }
}
