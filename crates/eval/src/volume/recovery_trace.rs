//! `understudy bench volume recovery-trace`: SpecREDS §6.2 "Performance on real recovery
//! workloads" (Figure 4c reads, Figure 4d writes).
//!
//! The paper records, with blktrace, the block I/O of a database recovering after a crash and
//! replays it with fio on a plain rbd disk, a `super` clone and an rbd general clone. This module
//! does the same against an Understudy cluster, in two steps:
//!
//! 1. [`record`]: a fresh volume is attached as ext4 (FUSE file → loop device → ext4, see
//!    `fusefile`) and SQLite is loaded on it (WAL mode, `synchronous=FULL`, rows of random blobs)
//!    until the checkpointed database and the un-checkpointed WAL reach their target sizes; the
//!    load is then SIGKILLed in the middle of its work. The volume is detached — which writes
//!    back what the kernel still caches, so this models an *application* crash, not a kernel
//!    panic or power loss — and attached again, without mkfs, through a [`TracingDev`] that
//!    records every block operation. The application's recovery then runs on it: the sqlite3
//!    CLI opens the database (rebuilding the WAL index from the WAL), checkpoints the WAL into
//!    the database (`PRAGMA wal_checkpoint(TRUNCATE)`), and runs `PRAGMA integrity_check` and a
//!    row count, which must say `ok` and find at least every row the load had acknowledged. The
//!    recorded [`Trace`] holds the mount's, the recovery's and the final `sync`'s reads and
//!    writes.
//! 2. [`replay`]: the trace is replayed, operation by operation in recorded order with synthetic
//!    data of the recorded sizes, on three variants: **plain** (the recorded volume itself: every
//!    object exists), **super** (a fresh collocated child of it: every object still uncopied) and
//!    **general** (a fresh rbd-style general clone). Each variant replays the whole trace several
//!    times, in ABBA order, on a fresh child / clone each time; children are collapsed (promoted:
//!    the parent stayed silent) and general clones deleted afterwards, waiting for garbage
//!    collection before the next replay.
//!
//! Replay depth: **1** (one operation in flight). A loop device issues one request at a time
//! (MACHINE-NOTES.md) and the recording notes the operations in flight at each issue
//! (`trace.in_flight_count_max`) so a reader can check that depth 1 is what was recorded.
//!
//! [`run`] does both and reports, per `BENCH.md`: `<variant>.recovery_trace.{read,write}.
//! latency_us_{mean,p50,p90,p99,p999,max}`, the same for writes split at the object size
//! (`write_small`: each needs a copy on a fresh super child; `write_large`: whole objects, no
//! copy), operation counts, the replay's total time per variant, the ratios `super_vs_plain.*`,
//! `general_vs_super.*` and `general_vs_plain.*` (mean and p99), the CDF plots
//! `fig4c_recovery_trace_read_cdf` and `fig4d_recovery_trace_write_cdf`, the trace itself
//! (`recovery_trace.csv`, loadable by [`Trace::load_csv`]) and every replayed latency
//! (`recovery_trace_replay.csv`).

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use bench::{LatencyRecorder, Progress, Report, Scale, Series};
use blockdev::{BlockDev, DevResult};

use volume::driver::client::{Cluster, Volume};
use volume::driver::meta::{MetaReq, MetaResp};
use volume::types::CollapseOutcome;

/// Most operations a [`TracingDev`] keeps (≈ 48 MB at most); past it, operations are counted in
/// [`Trace::ops_dropped`] and not recorded, and the run says so.
pub const TRACE_OPS_MAX: usize = 1_000_000;

/// The variants a trace is replayed on, in report order.
pub const VARIANTS: [&str; 3] = ["plain", "super", "general"];

/// Time allowed to the SQLite load, the recovery, and each attach / detach.
const LOAD_TIMEOUT: Duration = Duration::from_secs(600);
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(600);
/// How long the load runs past its target before it is killed, so that the kill lands in the
/// middle of a transaction rather than between two.
const KILL_AFTER_TARGET: Duration = Duration::from_millis(30);
/// The load reports its progress on stderr every this many MiB of rows.
const LOAD_PROGRESS_MIB: u64 = 16;
/// Name of the FUSE file the volume is exported as.
const DISK_FILE_NAME: &str = "disk.img";

// ---- Traces ----------------------------------------------------------------------------------

/// The kind of a block operation, as [`BlockDev`] names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    Read,
    Write,
    Flush,
    Trim,
    Zero,
}

impl OpKind {
    pub const ALL: [OpKind; 5] = [OpKind::Read, OpKind::Write, OpKind::Flush, OpKind::Trim, OpKind::Zero];

    pub fn name(self) -> &'static str {
        match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Flush => "flush",
            OpKind::Trim => "trim",
            OpKind::Zero => "zero",
        }
    }

    pub fn parse(name: &str) -> Option<OpKind> {
        OpKind::ALL.into_iter().find(|k| k.name() == name)
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One recorded block operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceOp {
    /// When it was issued, in microseconds since recording started.
    pub time_us: u64,
    pub kind: OpKind,
    pub offset_bytes: u64,
    /// Bytes read, written, trimmed or zeroed; 0 for a flush.
    pub len_bytes: u64,
    /// How long the recorded device took (for reference; replay measures its own).
    pub latency_us: u64,
    /// Operations in flight on the device when it was issued, itself included.
    pub in_flight_count: u32,
}

/// A block trace: successful operations in issue order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    pub ops: Vec<TraceOp>,
    /// Operations not recorded because the trace was full ([`TRACE_OPS_MAX`]).
    pub ops_dropped: u64,
    /// Operations that failed on the recorded device (not recorded: there is nothing to replay).
    pub ops_failed: u64,
}

const TRACE_CSV_HEADER: [&str; 6] = ["time_us", "kind", "offset_bytes", "len_bytes", "latency_us", "in_flight_count"];

impl Trace {
    pub fn count(&self, kind: OpKind) -> usize {
        self.ops.iter().filter(|op| op.kind == kind).count()
    }

    pub fn bytes(&self, kind: OpKind) -> u64 {
        self.ops.iter().filter(|op| op.kind == kind).map(|op| op.len_bytes).sum()
    }

    /// Time from the first operation's issue to the last one's completion.
    pub fn duration_us(&self) -> u64 {
        let first = self.ops.first().map_or(0, |op| op.time_us);
        let end = self.ops.iter().map(|op| op.time_us + op.latency_us).max().unwrap_or(0);
        end - first
    }

    /// Writes the operations as CSV (`time_us,kind,offset_bytes,len_bytes,latency_us,
    /// in_flight_count`); the dropped and failed counts are not part of the file.
    pub fn save_csv(&self, path: &Path) -> anyhow::Result<()> {
        let rows = self.ops.iter().map(|op| {
            vec![
                op.time_us.to_string(),
                op.kind.name().to_string(),
                op.offset_bytes.to_string(),
                op.len_bytes.to_string(),
                op.latency_us.to_string(),
                op.in_flight_count.to_string(),
            ]
        });
        bench::write_csv(path, &TRACE_CSV_HEADER, rows)?;
        Ok(())
    }

    /// Reads a trace written by [`Trace::save_csv`]; errors name the line that is wrong.
    pub fn load_csv(path: &Path) -> anyhow::Result<Trace> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading trace {}", path.display()))?;
        let mut lines = text.lines();
        let header = lines.next().unwrap_or_default();
        anyhow::ensure!(
            header == TRACE_CSV_HEADER.join(","),
            "{}: header {header:?} is not a trace header ({})",
            path.display(),
            TRACE_CSV_HEADER.join(",")
        );
        let mut ops = Vec::new();
        for (i, line) in lines.enumerate() {
            let bad = || anyhow::anyhow!("{} line {}: {line:?} is not a trace operation", path.display(), i + 2);
            let f: Vec<&str> = line.split(',').collect();
            if f.len() != TRACE_CSV_HEADER.len() {
                return Err(bad());
            }
            let num = |s: &str| s.parse::<u64>().map_err(|_| bad());
            ops.push(TraceOp {
                time_us: num(f[0])?,
                kind: OpKind::parse(f[1]).ok_or_else(bad)?,
                offset_bytes: num(f[2])?,
                len_bytes: num(f[3])?,
                latency_us: num(f[4])?,
                in_flight_count: u32::try_from(num(f[5])?).map_err(|_| bad())?,
            });
        }
        Ok(Trace { ops, ops_dropped: 0, ops_failed: 0 })
    }
}

/// A [`BlockDev`] that passes every operation to `inner` and, while recording is on, notes it
/// in a bounded in-memory trace ([`TRACE_OPS_MAX`] operations by default).
pub struct TracingDev<D> {
    inner: D,
    recording: AtomicBool,
    /// When recording was first switched on; trace times count from here.
    origin: OnceLock<Instant>,
    ops: Mutex<Vec<TraceOp>>,
    ops_max: usize,
    ops_dropped: AtomicU64,
    ops_failed: AtomicU64,
    in_flight: AtomicU64,
}

/// What [`TracingDev`] knows about an operation when it is issued.
struct Issued {
    started: Instant,
    /// Some(time since origin) if recording was on at issue.
    time_us: Option<u64>,
    in_flight_count: u32,
}

impl<D: BlockDev> TracingDev<D> {
    /// A tracing wrapper with recording off and room for [`TRACE_OPS_MAX`] operations.
    pub fn new(inner: D) -> Self {
        Self::with_limit(inner, TRACE_OPS_MAX)
    }

    pub fn with_limit(inner: D, ops_max: usize) -> Self {
        TracingDev {
            inner,
            recording: AtomicBool::new(false),
            origin: OnceLock::new(),
            ops: Mutex::new(Vec::new()),
            ops_max,
            ops_dropped: AtomicU64::new(0),
            ops_failed: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
        }
    }

    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Switches recording on or off. Operations issued while it is on are recorded when they
    /// complete; times count from the first time it was switched on.
    pub fn set_recording(&self, on: bool) {
        if on {
            self.origin.get_or_init(Instant::now);
        }
        self.recording.store(on, Ordering::SeqCst);
    }

    /// Takes the trace recorded so far (sorted by issue time) and starts an empty one.
    pub fn take_trace(&self) -> Trace {
        let mut ops = std::mem::take(&mut *self.ops.lock().unwrap());
        // Operations are pushed as they complete; concurrent ones may complete out of order.
        ops.sort_by_key(|op| op.time_us);
        Trace {
            ops,
            ops_dropped: self.ops_dropped.swap(0, Ordering::SeqCst),
            ops_failed: self.ops_failed.swap(0, Ordering::SeqCst),
        }
    }

    fn issue(&self) -> Issued {
        let in_flight_count = (self.in_flight.fetch_add(1, Ordering::SeqCst) + 1).min(u32::MAX as u64) as u32;
        let started = Instant::now();
        let time_us = match (self.recording.load(Ordering::SeqCst), self.origin.get()) {
            (true, Some(origin)) => Some(started.duration_since(*origin).as_micros() as u64),
            _ => None,
        };
        Issued { started, time_us, in_flight_count }
    }

    fn complete(&self, issued: Issued, kind: OpKind, offset_bytes: u64, len_bytes: u64, ok: bool) {
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        let Some(time_us) = issued.time_us else { return };
        if !ok {
            self.ops_failed.fetch_add(1, Ordering::SeqCst);
            return;
        }
        let op = TraceOp {
            time_us,
            kind,
            offset_bytes,
            len_bytes,
            latency_us: issued.started.elapsed().as_micros() as u64,
            in_flight_count: issued.in_flight_count,
        };
        let mut ops = self.ops.lock().unwrap();
        if ops.len() < self.ops_max {
            ops.push(op);
        } else {
            self.ops_dropped.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl<D: BlockDev> BlockDev for TracingDev<D> {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    async fn read(&self, offset: u64, len: u32) -> DevResult<Vec<u8>> {
        let issued = self.issue();
        let r = self.inner.read(offset, len).await;
        self.complete(issued, OpKind::Read, offset, len as u64, r.is_ok());
        r
    }

    async fn write(&self, offset: u64, data: Vec<u8>) -> DevResult<()> {
        let len = data.len() as u64;
        let issued = self.issue();
        let r = self.inner.write(offset, data).await;
        self.complete(issued, OpKind::Write, offset, len, r.is_ok());
        r
    }

    async fn flush(&self) -> DevResult<()> {
        let issued = self.issue();
        let r = self.inner.flush().await;
        self.complete(issued, OpKind::Flush, 0, 0, r.is_ok());
        r
    }

    async fn trim(&self, offset: u64, len: u64) -> DevResult<()> {
        let issued = self.issue();
        let r = self.inner.trim(offset, len).await;
        self.complete(issued, OpKind::Trim, offset, len, r.is_ok());
        r
    }

    async fn write_zeroes(&self, offset: u64, len: u64) -> DevResult<()> {
        let issued = self.issue();
        let r = self.inner.write_zeroes(offset, len).await;
        self.complete(issued, OpKind::Zero, offset, len, r.is_ok());
        r
    }
}

// ---- Options ---------------------------------------------------------------------------------

/// Sizes of the recorded crash and of the replay.
#[derive(Debug, Clone)]
pub struct TraceOptions {
    pub quick: bool,
    pub volume_size_bytes: u64,
    pub object_size_bytes: u32,
    /// The load first grows the database file (WAL checkpointed as SQLite does by default) to
    /// this size, then turns automatic checkpoints off ...
    pub db_checkpointed_bytes: u64,
    /// ... and goes on until the WAL holds this much, then is killed: recovery must replay it.
    pub wal_bytes: u64,
    /// Random blob bytes per row, and rows per transaction (one fsync'd commit each).
    pub row_bytes: u32,
    pub rows_per_txn: u32,
    /// Times each variant replays the whole trace (ABBA order, a fresh child or clone each time).
    pub replay_rounds: usize,
    /// Where the mount directory and the load script go; `None`: a fresh directory under the
    /// system temp dir, removed at the end.
    pub work_dir: Option<PathBuf>,
}

impl TraceOptions {
    /// Quick: a 256 MiB volume, ≈ 30 MiB of database of which 16 MiB is WAL at the kill, four
    /// replays per variant; fits in under a minute with the cluster's start-up (≈ 40 s
    /// measured). Full: 1 GiB, 128 MiB checkpointed + 64 MiB of WAL at the kill, three replays
    /// per variant, sized to finish within about eight minutes on a shared 2-core machine (the
    /// earlier 512 + 256 MiB with four rounds did not finish on a loaded one: a 135k-operation
    /// trace took ≈ 50 s a replay, and the load itself several minutes).
    pub fn new(quick: bool) -> Self {
        const MIB: u64 = 1 << 20;
        TraceOptions {
            quick,
            volume_size_bytes: if quick { 256 * MIB } else { 1024 * MIB },
            object_size_bytes: 64 * 1024,
            db_checkpointed_bytes: if quick { 14 * MIB } else { 128 * MIB },
            wal_bytes: if quick { 16 * MIB } else { 64 * MIB },
            row_bytes: 2000,
            rows_per_txn: 64,
            replay_rounds: if quick { 4 } else { 3 },
            work_dir: None,
        }
    }
}

// ---- Recording -------------------------------------------------------------------------------

/// The load: WAL, synchronous=FULL, transactions of random blobs; prints `acked N` after each
/// commit returns (so every printed row is durable) and `target DB_BYTES WAL_BYTES` once the
/// WAL is big enough, then keeps loading until it is killed (or gives up after 10 s).
const LOAD_PY: &str = r#"
import os, sqlite3, sys, time
db_path = sys.argv[1]
checkpointed_bytes, wal_bytes, row_bytes, rows_per_txn = map(int, sys.argv[2:6])
def size(p):
    try:
        return os.path.getsize(p)
    except FileNotFoundError:
        return 0
db = sqlite3.connect(db_path, isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("PRAGMA synchronous=FULL")
db.execute("CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, payload BLOB NOT NULL)")
acked = 0
phase = "fill"
while True:
    db.execute("BEGIN")
    for _ in range(rows_per_txn):
        db.execute("INSERT INTO t (payload) VALUES (?)", (os.urandom(row_bytes),))
    db.execute("COMMIT")
    acked += rows_per_txn
    print(f"acked {acked}", flush=True)
    if phase == "fill" and size(db_path) >= checkpointed_bytes:
        # From here on every page stays in the WAL: recovery has to replay all of it.
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        db.execute("PRAGMA wal_autocheckpoint=0")
        phase = "wal"
    elif phase == "wal" and size(db_path + "-wal") >= wal_bytes:
        print(f"target {size(db_path)} {size(db_path + '-wal')}", flush=True)
        phase = "past"
        give_up = time.monotonic() + 10
    elif phase == "past" and time.monotonic() > give_up:
        sys.exit("load: not killed within 10 s of reaching the target")
"#;

/// What the recording found out about the application, besides the trace.
#[derive(Debug, Clone)]
pub struct Recording {
    /// The recorded volume (left in place for [`replay`]).
    pub volume: String,
    pub trace: Trace,
    /// Rows whose commit had returned before the kill.
    pub rows_acked_count: u64,
    /// Rows found by the recovery's count.
    pub rows_recovered_count: u64,
    /// `PRAGMA integrity_check`'s answer (`ok` when sound).
    pub integrity: String,
    /// File sizes when the load reached its target (just before the kill).
    pub db_file_bytes: u64,
    pub wal_bytes: u64,
    /// Wall time of the load (until the kill), and of the application's recovery (the sqlite3
    /// run: WAL recovery, checkpoint, integrity check, count) on the recorded volume.
    pub load_ms: u64,
    pub recovery_ms: u64,
}

impl Recording {
    /// The recovery was sound: integrity ok and no acknowledged row lost.
    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.integrity == "ok", "SQLite integrity_check after recovery said {:?}", self.integrity);
        anyhow::ensure!(
            self.rows_recovered_count >= self.rows_acked_count,
            "recovery lost acknowledged rows: {} acknowledged before the kill, {} found after",
            self.rows_acked_count,
            self.rows_recovered_count
        );
        Ok(())
    }
}

static RUN_SEQ: AtomicU64 = AtomicU64::new(0);

/// A name unique to this process and call.
fn unique(prefix: &str) -> String {
    format!("{prefix}-{}-{}", std::process::id(), RUN_SEQ.fetch_add(1, Ordering::SeqCst))
}

/// Runs a blocking step (attach, detach, a child process) off the runtime's worker threads,
/// as fusefile requires.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> anyhow::Result<T> + Send + 'static) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(f).await.context("a blocking step panicked")?
}

/// Runs `cmd`, killing it (by its PID) after `timeout`; returns stdout, or an error with stderr.
fn run_command(cmd: &mut Command, timeout: Duration) -> anyhow::Result<String> {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let watchdog = Watchdog::start(child.id(), timeout);
    let mut stdout = String::new();
    let _ = out.read_to_string(&mut stdout);
    watchdog.stop();
    let status = child.wait().with_context(|| format!("waiting for {what}"))?;
    let stderr = err_reader.join().unwrap_or_default();
    anyhow::ensure!(status.success(), "{what} failed ({status}): {}", stderr.trim());
    Ok(stdout)
}

/// Kills a child process by PID if it runs past its deadline. Call [`Watchdog::stop`] after the
/// child's output ends and *before* reaping it, so a reused PID can never be hit.
struct Watchdog {
    done: Arc<AtomicBool>,
}

impl Watchdog {
    fn start(pid: u32, timeout: Duration) -> Watchdog {
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        std::thread::spawn(move || {
            let deadline = Instant::now() + timeout;
            while !flag.load(Ordering::SeqCst) {
                if Instant::now() > deadline {
                    tracing::warn!("bench_trace: process {pid} ran past {timeout:?}; killing it");
                    // SAFETY: kill(2) has no memory-safety preconditions; `pid` is our unreaped
                    // child (the watchdog is stopped before the child is waited for).
                    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        Watchdog { done }
    }

    fn stop(&self) {
        self.done.store(true, Ordering::SeqCst);
    }
}

/// What the load reported before it was killed.
struct LoadOutcome {
    rows_acked_count: u64,
    db_file_bytes: u64,
    wal_bytes: u64,
}

/// Runs the load script until it reports its target, then SIGKILLs it mid-transaction.
fn load_and_kill(script: &Path, db: &Path, opts: &TraceOptions) -> anyhow::Result<LoadOutcome> {
    let mut child = Command::new("python3")
        .arg(script)
        .arg(db)
        .args([opts.db_checkpointed_bytes, opts.wal_bytes, opts.row_bytes as u64, opts.rows_per_txn as u64].map(|n| n.to_string()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the SQLite load (python3 with its sqlite3 module)")?;
    let watchdog = Watchdog::start(child.id(), LOAD_TIMEOUT);
    let mut err = child.stderr.take().unwrap();
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut outcome = LoadOutcome { rows_acked_count: 0, db_file_bytes: 0, wal_bytes: 0 };
    let mut killed = false;
    // Progress on stderr: rows acknowledged, as bytes of blobs, against the load's target.
    let target_mib = (opts.db_checkpointed_bytes + opts.wal_bytes) >> 20;
    let (started, mut shown_mib) = (Instant::now(), 0);
    // Read to the end, also after the kill: lines already in the pipe are acknowledged rows.
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.context("reading the load's output")?;
        if let Some(n) = line.strip_prefix("acked ") {
            outcome.rows_acked_count = outcome.rows_acked_count.max(n.parse().context("load printed a bad count")?);
            let mib = (outcome.rows_acked_count * opts.row_bytes as u64) >> 20;
            if mib >= shown_mib + LOAD_PROGRESS_MIB {
                shown_mib = mib;
                eprintln!("SQLite load: {mib} MiB of rows committed (target ≈ {target_mib} MiB) after {:.0} s", started.elapsed().as_secs_f64());
            }
        } else if let Some(sizes) = line.strip_prefix("target ") {
            let mut it = sizes.split(' ').map(|s| s.parse::<u64>().unwrap_or(0));
            outcome.db_file_bytes = it.next().unwrap_or(0);
            outcome.wal_bytes = it.next().unwrap_or(0);
            if !killed {
                std::thread::sleep(KILL_AFTER_TARGET);
                // Child::kill sends SIGKILL to this child's PID.
                child.kill().context("SIGKILL of the load")?;
                killed = true;
            }
        }
    }
    watchdog.stop();
    let status = child.wait().context("waiting for the load")?;
    let stderr = err_reader.join().unwrap_or_default();
    anyhow::ensure!(killed, "the SQLite load ended before reaching its target ({status}): {}", stderr.trim());
    Ok(outcome)
}

/// What the recovery found.
struct RecoveryOutcome {
    integrity: String,
    rows_recovered_count: u64,
}

/// The application's recovery: the sqlite3 CLI opens the crashed database (rebuilding the WAL
/// index from the WAL), checkpoints the WAL into the database, checks it, and counts rows.
fn recover(db: &Path) -> anyhow::Result<RecoveryOutcome> {
    let sql = "PRAGMA wal_checkpoint(TRUNCATE);\n\
               SELECT 'integrity=' || group_concat(integrity_check, '; ') FROM pragma_integrity_check;\n\
               SELECT 'rows=' || count(*) FROM t;";
    let out = run_command(Command::new("sqlite3").arg("-bail").arg(db).arg(sql), RECOVERY_TIMEOUT)
        .context("SQLite recovery (the sqlite3 CLI must be installed)")?;
    let mut lines = out.lines();
    let checkpoint = lines.next().unwrap_or_default();
    anyhow::ensure!(checkpoint.starts_with("0|"), "wal_checkpoint(TRUNCATE) was busy or failed: {checkpoint:?}");
    let mut outcome = RecoveryOutcome { integrity: String::new(), rows_recovered_count: 0 };
    for line in lines {
        if let Some(s) = line.strip_prefix("integrity=") {
            outcome.integrity = s.to_string();
        } else if let Some(n) = line.strip_prefix("rows=") {
            outcome.rows_recovered_count = n.parse().context("sqlite3 printed a bad row count")?;
        }
    }
    Ok(outcome)
}

fn attach_config(runtime: &tokio::runtime::Handle) -> fusefile::AttachConfig {
    fusefile::AttachConfig::new(DISK_FILE_NAME, runtime.clone())
}

/// Puts ext4 on the volume through its FUSE file (no loop device needed for mkfs). Inode tables
/// and the journal are initialised now, not lazily: otherwise the kernel's `ext4lazyinit`
/// thread would go on zeroing them after mount — into the recovery's trace. No discard: the
/// volume is new, so there is nothing to discard.
fn mkfs(dev: Arc<TracingDev<Volume>>, work_dir: &Path, runtime: tokio::runtime::Handle) -> anyhow::Result<()> {
    let fuse_dir = work_dir.join("mkfs-fuse");
    std::fs::create_dir_all(&fuse_dir)?;
    let fuse = fusefile::mount_with(dev, &fuse_dir, fusefile::MountConfig::new(DISK_FILE_NAME, runtime))?;
    let r = run_command(
        Command::new("mkfs.ext4").args(["-q", "-F", "-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0"]).arg(fuse.file_path()),
        Duration::from_secs(600),
    );
    fuse.unmount()?;
    r.map(|_| ())
}

/// Records the block trace of SQLite recovering from a SIGKILL mid-load (see the module doc).
pub async fn record(cluster: Arc<Cluster>, opts: &TraceOptions) -> anyhow::Result<Recording> {
    let work_dir = match &opts.work_dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(unique("understudy-trace")),
    };
    let mount_dir = work_dir.join("mnt");
    std::fs::create_dir_all(&mount_dir).with_context(|| format!("creating {}", mount_dir.display()))?;
    let script = work_dir.join("load.py");
    std::fs::write(&script, LOAD_PY)?;
    let volume = unique("trace");
    cluster
        .meta(MetaReq::Create { name: volume.clone(), size_bytes: opts.volume_size_bytes, object_size_bytes: opts.object_size_bytes })
        .await
        .context("creating the volume to record on")?;
    let recorded = record_on(&cluster, &volume, opts, &work_dir, &mount_dir, &script).await;
    if opts.work_dir.is_none() {
        let _ = std::fs::remove_dir_all(&work_dir);
    }
    if recorded.is_err() {
        // Best effort: do not leave a half-recorded volume behind (a failed detach may still
        // hold it, in which case the delete fails too and the error below says what happened).
        let _ = cluster.meta(MetaReq::Delete { name: volume.clone() }).await;
    }
    recorded
}

async fn record_on(cluster: &Arc<Cluster>, volume: &str, opts: &TraceOptions, work_dir: &Path, mount_dir: &Path, script: &Path) -> anyhow::Result<Recording> {
    let runtime = tokio::runtime::Handle::current();
    let db = mount_dir.join("recovery.db");
    // Load until the target, then crash the application.
    let mut progress = Progress::new(2, "recording: mkfs + SQLite load, then recovery");
    let dev = Arc::new(TracingDev::new(cluster.open(volume).await?));
    let load = {
        let (dev, work_dir, mount_dir, script, rt, opts) =
            (dev.clone(), work_dir.to_path_buf(), mount_dir.to_path_buf(), script.to_path_buf(), runtime.clone(), opts.clone());
        blocking(move || {
            mkfs(dev.clone(), &work_dir, rt.clone()).context("mkfs.ext4 on the volume")?;
            let attached = fusefile::attach(dev, &mount_dir, attach_config(&rt)).context("attaching the volume for the load")?;
            let load_started = Instant::now();
            let outcome = load_and_kill(&script, &db, &opts).map(|o| (o, load_started.elapsed()));
            // Detaching unmounts ext4, which writes back whatever the kernel still caches.
            fusefile::detach(attached).context("detaching after the crash")?;
            outcome
        })
        .await?
    };
    let (load, load_time) = load;
    drop(dev);
    progress.inc(1);

    // Recover with recording on, from the mount onward.
    let dev = Arc::new(TracingDev::new(cluster.open(volume).await?));
    dev.set_recording(true);
    let recovered = {
        let (dev, mount_dir, rt) = (dev.clone(), mount_dir.to_path_buf(), runtime.clone());
        blocking(move || {
            let attached = fusefile::attach(dev.clone(), &mount_dir, attach_config(&rt)).context("attaching the volume for recovery")?;
            let recovery_started = Instant::now();
            let outcome = recover(&mount_dir.join("recovery.db")).map(|o| (o, recovery_started.elapsed())).and_then(|o| {
                // Write back what the recovery left dirty (e.g. inode times), as the kernel
                // would within seconds anyway, so it is part of the trace.
                run_command(Command::new("sync").arg("-f").arg(&mount_dir), Duration::from_secs(120))?;
                Ok(o)
            });
            dev.set_recording(false);
            fusefile::detach(attached).context("detaching after recovery")?;
            outcome
        })
        .await?
    };
    let (recovered, recovery_time) = recovered;
    let trace = dev.take_trace();
    drop(dev);
    progress.inc(1);
    progress.finish();
    if trace.ops_dropped > 0 {
        eprintln!(
            "recovery-trace: the trace is full at {TRACE_OPS_MAX} operations; {} later operations were not recorded",
            trace.ops_dropped
        );
    }
    Ok(Recording {
        volume: volume.to_string(),
        trace,
        rows_acked_count: load.rows_acked_count,
        rows_recovered_count: recovered.rows_recovered_count,
        integrity: recovered.integrity,
        db_file_bytes: load.db_file_bytes,
        wal_bytes: load.wal_bytes,
        load_ms: load_time.as_millis() as u64,
        recovery_ms: recovery_time.as_millis() as u64,
    })
}

// ---- Replay ----------------------------------------------------------------------------------

/// Latencies of every replay, per variant.
pub struct ReplayResult {
    /// `latency[variant][OpKind::index]`.
    pub latency: [[LatencyRecorder; 5]; 3],
    /// Write latencies split by size, `write_by_size[variant][0]` for writes smaller than an
    /// object (on a fresh super child, each needs a copy of the object first) and `[1]` for
    /// writes of an object or more (whole objects are written without a copy).
    pub write_by_size: [[LatencyRecorder; 2]; 3],
    pub object_size_bytes: u32,
    /// Wall time of each whole replay, per variant, in microseconds.
    pub replay_us: [Vec<u64>; 3],
    /// `(variant, round, op index, latency µs)` of every replayed operation.
    pub samples: Vec<(usize, usize, usize, u64)>,
}

impl ReplayResult {
    pub fn recorder(&self, variant: usize, kind: OpKind) -> &LatencyRecorder {
        &self.latency[variant][kind.index()]
    }
}

/// Replays `trace` at depth 1 with synthetic data; returns each operation's latency in µs.
async fn replay_once(vol: &Volume, trace: &Trace, data: &[u8]) -> anyhow::Result<Vec<u64>> {
    let mut latency_us = Vec::with_capacity(trace.ops.len());
    for op in &trace.ops {
        let (offset, len) = (op.offset_bytes, op.len_bytes);
        // The write's buffer is made before the clock starts.
        let payload = if op.kind == OpKind::Write { data[..len as usize].to_vec() } else { Vec::new() };
        let started = Instant::now();
        let r = match op.kind {
            OpKind::Read => vol.read(offset, len as u32).await.map(|_| ()),
            OpKind::Write => vol.write(offset, payload).await,
            OpKind::Flush => vol.flush().await,
            OpKind::Trim => vol.trim(offset, len).await,
            OpKind::Zero => vol.write_zeroes(offset, len).await,
        };
        latency_us.push(started.elapsed().as_micros() as u64);
        r.map_err(|e| anyhow::anyhow!("replayed {} of {len} bytes at {offset} failed: {e}", op.kind.name()))?;
    }
    Ok(latency_us)
}

async fn meta_ok(cluster: &Cluster, req: MetaReq) -> anyhow::Result<MetaResp> {
    let what = format!("{req:?}");
    cluster.meta(req).await.with_context(|| format!("metadata request {what}"))
}

/// Replays `trace` on the plain volume `volume`, fresh `super` children of it and fresh general
/// clones of it, `rounds` times each in ABBA order. Each super child is collapsed afterwards
/// (promoted, as its parent stayed silent) and becomes the plain volume of the next replays;
/// each general clone is deleted. Returns the name the plain volume ends up with.
pub async fn replay(cluster: Arc<Cluster>, volume: &str, trace: &Trace, rounds: usize) -> anyhow::Result<(ReplayResult, String)> {
    anyhow::ensure!(!trace.ops.is_empty(), "the trace is empty: nothing to replay");
    let max_write = trace.ops.iter().filter(|op| op.kind == OpKind::Write).map(|op| op.len_bytes).max().unwrap_or(0);
    // Synthetic data: a non-zero pattern, so no layer can treat it as a hole.
    let data: Vec<u8> = (0..max_write).map(|i| (i % 251) as u8 | 1).collect();
    let object_size_bytes = cluster.volume_info(volume).await?.vol.object_size_bytes;
    let mut result =
        ReplayResult { latency: Default::default(), write_by_size: Default::default(), object_size_bytes, replay_us: Default::default(), samples: Vec::new() };
    let mut base = volume.to_string();
    let order = bench::interleaved_order(rounds, VARIANTS.len());
    let mut progress = Progress::new(order.len() as u64, "replaying the recovery trace");
    for (step, &variant) in order.iter().enumerate() {
        let round = step / VARIANTS.len();
        // Garbage collection of the previous child must not run under this replay.
        cluster.wait_for_jobs().await?;
        let target = match variant {
            0 => base.clone(),
            1 => {
                let child = format!("{volume}.super-{step}");
                meta_ok(&cluster, MetaReq::Super { parent: base.clone(), child: child.clone() }).await?;
                child
            }
            _ => {
                let clone = format!("{volume}.general-{step}");
                meta_ok(&cluster, MetaReq::CloneGeneral { parent: base.clone(), child: clone.clone() }).await?;
                clone
            }
        };
        let vol = cluster.open(&target).await?;
        let started = Instant::now();
        let latency_us = replay_once(&vol, trace, &data).await.with_context(|| format!("replay on {} ({target})", VARIANTS[variant]))?;
        result.replay_us[variant].push(started.elapsed().as_micros() as u64);
        drop(vol);
        for (i, (op, us)) in trace.ops.iter().zip(latency_us).enumerate() {
            result.latency[variant][op.kind.index()].record_us(us);
            if op.kind == OpKind::Write {
                result.write_by_size[variant][(op.len_bytes >= object_size_bytes as u64) as usize].record_us(us);
            }
            result.samples.push((variant, round, i, us));
        }
        match variant {
            1 => match meta_ok(&cluster, MetaReq::Collapse { child: target.clone() }).await? {
                MetaResp::Collapsed { outcome: CollapseOutcome::Promoted, .. } => base = target,
                other => anyhow::bail!("collapse of {target} with a silent parent did not promote: {other:?}"),
            },
            2 => {
                meta_ok(&cluster, MetaReq::Delete { name: target }).await?;
            }
            _ => {}
        }
        progress.inc(1);
    }
    cluster.wait_for_jobs().await?;
    progress.finish();
    Ok((result, base))
}

// ---- Report ----------------------------------------------------------------------------------

/// Adds the recording's and the replay's figures, ratios, plots and CSV files.
pub fn report_figures(recording: &Recording, replayed: &ReplayResult, rounds: usize, out: &Path, report: &mut Report) -> anyhow::Result<()> {
    let trace = &recording.trace;
    for kind in OpKind::ALL {
        report.figure(&format!("trace.{}_count", kind.name()), trace.count(kind) as f64)?;
    }
    report.figure("trace.read_bytes", trace.bytes(OpKind::Read) as f64)?;
    report.figure("trace.write_bytes", trace.bytes(OpKind::Write) as f64)?;
    report.figure("trace.ops_dropped_count", trace.ops_dropped as f64)?;
    report.figure("trace.ops_failed_count", trace.ops_failed as f64)?;
    report.figure("trace.duration_ms", trace.duration_us() as f64 / 1000.0)?;
    let in_flight = trace.ops.iter().map(|op| op.in_flight_count as f64);
    report.figure("trace.in_flight_count_max", in_flight.clone().fold(0.0, f64::max))?;
    report.figure("trace.in_flight_count_mean", in_flight.sum::<f64>() / trace.ops.len().max(1) as f64)?;
    report.figure("app.rows_acked_count", recording.rows_acked_count as f64)?;
    report.figure("app.rows_recovered_count", recording.rows_recovered_count as f64)?;
    report.figure("app.db_file_at_kill_bytes", recording.db_file_bytes as f64)?;
    report.figure("app.wal_at_kill_bytes", recording.wal_bytes as f64)?;
    report.figure("app.load_ms", recording.load_ms as f64)?;
    report.figure("app.recovery_ms", recording.recovery_ms as f64)?;
    report.figure("replay.depth_count", 1.0)?;
    report.figure("replay.rounds_count", rounds as f64)?;

    for (v, name) in VARIANTS.iter().enumerate() {
        for kind in [OpKind::Read, OpKind::Write] {
            report.latency(&format!("{name}.recovery_trace.{}.latency", kind.name()), &replayed.recorder(v, kind).summary())?;
            report.figure(&format!("{name}.recovery_trace.{}.ops_count", kind.name()), replayed.recorder(v, kind).count() as f64)?;
        }
        for (class, r) in ["write_small", "write_large"].iter().zip(&replayed.write_by_size[v]) {
            // A trace may have no writes of one class; the report refuses empty latencies.
            if r.count() > 0 {
                report.latency(&format!("{name}.recovery_trace.{class}.latency"), &r.summary())?;
                report.figure(&format!("{name}.recovery_trace.{class}.ops_count"), r.count() as f64)?;
            }
        }
        let times = &replayed.replay_us[v];
        report.figure(&format!("{name}.recovery_trace.replay_time_ms_mean"), times.iter().sum::<u64>() as f64 / times.len().max(1) as f64 / 1000.0)?;
    }
    let mean = |v: usize, k: OpKind| replayed.recorder(v, k).mean_us();
    let p99 = |v: usize, k: OpKind| replayed.recorder(v, k).percentile_us(99.0) as f64;
    let replay_ms = |v: usize| replayed.replay_us[v].iter().sum::<u64>() as f64;
    for (label, a, b) in [("super_vs_plain", 1, 0), ("general_vs_super", 2, 1), ("general_vs_plain", 2, 0)] {
        for kind in [OpKind::Read, OpKind::Write] {
            report.ratio(&format!("{label}.recovery_trace.{}.latency", kind.name()), mean(a, kind), mean(b, kind))?;
            report.ratio(&format!("{label}.recovery_trace.{}.latency_p99", kind.name()), p99(a, kind), p99(b, kind))?;
        }
        report.ratio(&format!("{label}.recovery_trace.replay_time"), replay_ms(a), replay_ms(b))?;
        for (class, c) in [("write_small", 0), ("write_large", 1)] {
            let (ra, rb) = (&replayed.write_by_size[a][c], &replayed.write_by_size[b][c]);
            if ra.count() > 0 && rb.count() > 0 {
                report.ratio(&format!("{label}.recovery_trace.{class}.latency"), ra.mean_us(), rb.mean_us())?;
            }
        }
    }

    trace.save_csv(&out.join("recovery_trace.csv"))?;
    let rows = replayed.samples.iter().map(|&(v, round, i, us)| {
        let op = &trace.ops[i];
        vec![VARIANTS[v].to_string(), round.to_string(), i.to_string(), op.kind.name().to_string(), op.len_bytes.to_string(), us.to_string()]
    });
    bench::write_csv(&out.join("recovery_trace_replay.csv"), &["variant", "round", "op_index", "kind", "len_bytes", "latency_us"], rows)?;
    for (stem, kind, figure) in [("fig4c_recovery_trace_read_cdf", OpKind::Read, "4c"), ("fig4d_recovery_trace_write_cdf", OpKind::Write, "4d")] {
        let series: Vec<Series> = VARIANTS
            .iter()
            .enumerate()
            .map(|(v, n)| Series {
                name: n.to_string(),
                points: replayed.recorder(v, kind).cdf_points().into_iter().map(|(us, f)| (us / 1000.0, f)).collect(),
            })
            .collect();
        bench::cdf_plot(
            &out.join(stem),
            &format!("Recovery trace replay: {} latency (cf. Figure {figure})", kind.name()),
            &format!("{} latency (ms)", kind.name()),
            &series,
            Scale::Log,
        )?;
    }
    Ok(())
}

/// Record + replay + report with explicit options; returns the recording for callers that check
/// the application's recovery (tests).
pub async fn run_with(cluster: Arc<Cluster>, opts: &TraceOptions, out: &Path, report: &mut Report) -> anyhow::Result<Recording> {
    let recording = record(cluster.clone(), opts).await?;
    // A recovery that lost data or broke the database is not a recovery worth timing.
    recording.check()?;
    anyhow::ensure!(
        recording.trace.count(OpKind::Read) > 0 && recording.trace.count(OpKind::Write) > 0,
        "the recovery trace has {} reads and {} writes; both are needed",
        recording.trace.count(OpKind::Read),
        recording.trace.count(OpKind::Write)
    );
    let (replayed, final_volume) = replay(cluster.clone(), &recording.volume, &recording.trace, opts.replay_rounds).await?;
    report_figures(&recording, &replayed, opts.replay_rounds, out, report)?;
    meta_ok(&cluster, MetaReq::Delete { name: final_volume }).await?;
    cluster.wait_for_jobs().await?;
    Ok(recording)
}

/// `understudy bench volume recovery-trace [--quick]`: records SQLite's crash recovery and
/// replays it on plain, super and general clone volumes (see the module doc).
pub async fn run(cluster: Arc<Cluster>, quick: bool, out: &Path, report: &mut Report) -> anyhow::Result<()> {
    run_with(cluster, &TraceOptions::new(quick), out, report).await.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockdev::MemDev;

    #[tokio::test]
    async fn tracing_dev_records_only_while_on_and_up_to_its_limit() {
        let dev = TracingDev::with_limit(MemDev::new(1 << 20), 3);
        dev.write(0, vec![1; 512]).await.unwrap();
        dev.set_recording(true);
        dev.write(4096, vec![2; 1024]).await.unwrap();
        assert_eq!(dev.read(4096, 1024).await.unwrap(), vec![2; 1024]);
        dev.flush().await.unwrap();
        dev.trim(0, 4096).await.unwrap();
        assert!(dev.read(1 << 20, 1).await.is_err());
        dev.set_recording(false);
        dev.write_zeroes(0, 10).await.unwrap();
        let t = dev.take_trace();
        let kinds: Vec<OpKind> = t.ops.iter().map(|o| o.kind).collect();
        assert_eq!(kinds, [OpKind::Write, OpKind::Read, OpKind::Flush]);
        assert_eq!((t.ops[0].offset_bytes, t.ops[0].len_bytes), (4096, 1024));
        assert_eq!(t.ops_dropped, 1, "the trim is past the limit of 3");
        assert_eq!(t.ops_failed, 1, "the out-of-range read");
        assert!(t.ops.windows(2).all(|w| w[0].time_us <= w[1].time_us));
    }

    #[test]
    fn trace_csv_round_trips_and_rejects_garbage() {
        let dir = std::env::temp_dir().join(unique("understudy-trace-csv"));
        std::fs::create_dir_all(&dir).unwrap();
        let trace = Trace {
            ops: vec![
                TraceOp { time_us: 5, kind: OpKind::Read, offset_bytes: 4096, len_bytes: 8192, latency_us: 70, in_flight_count: 1 },
                TraceOp { time_us: 90, kind: OpKind::Zero, offset_bytes: 0, len_bytes: 1 << 20, latency_us: 3, in_flight_count: 2 },
            ],
            ops_dropped: 0,
            ops_failed: 0,
        };
        let path = dir.join("t.csv");
        trace.save_csv(&path).unwrap();
        assert_eq!(Trace::load_csv(&path).unwrap(), trace);
        std::fs::write(&path, "time_us,kind,offset_bytes,len_bytes,latency_us,in_flight_count\n1,scribble,0,0,0,1\n").unwrap();
        let e = Trace::load_csv(&path).unwrap_err().to_string();
        assert!(e.contains("line 2"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
