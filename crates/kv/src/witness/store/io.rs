//! The backup's SSD I/O scheduler (paper §5.3 and §7.7: BatchPull is rate-limited "so
//! PriorityPulls stay fast"; spec (c) "SSD I/O thread"): a small pool of threads doing
//! synchronous `O_DIRECT` I/O on [`SsdLogs`], fed by strict priority classes
//! PriorityPull > Writeback > BatchPull > Gc, each with its own in-flight limit, and a token
//! bucket (bytes/s) on BatchPull.
//!
//! Requests and control messages go in over one bounded channel (so a control message takes
//! effect after every request sent before it); completions come out over another, in completion
//! order, each tagged with the caller's `id`. A full request channel blocks [`IoSubmitter::submit`]
//! ([`IoSubmitter::try_submit`] hands the request back instead): backpressure, never an unbounded
//! queue. The pool size is the device queue depth: with synchronous reads, N workers keep at most
//! N requests at the disk.
//!
//! Scheduling is work-conserving: a BatchPull held back only by its token bucket lets a Gc request
//! run. Priority decides which request *starts* next; a request already at the disk is never
//! preempted, so a PriorityPull waits at most for one in-flight request per worker.

use std::collections::VecDeque;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::ssdlog::{AlignedBuf, LogKind, SsdError, SsdLogs};
/// The priority classes: the core's own enum (one for the core's outputs and this pool).
pub use crate::witness::core::ssd::IoClass;

pub const CLASSES: [IoClass; 4] = [
    IoClass::PriorityPull,
    IoClass::Writeback,
    IoClass::BatchPull,
    IoClass::Gc,
];

/// One SSD operation.
#[derive(Debug)]
pub enum IoOp {
    /// Raw pages `[off, off + len)` of a segment (rounded out to pages): the core's reads
    /// (PriorityPull pages, BatchPull streaming, GC) and the benchmark.
    Read { seg: u64, off: u64, len: usize },
    /// Whole pages written at `off` of a segment (created if new) and synced; durable when it
    /// completes (the core's writeback batches and GC rewrites).
    Write {
        seg: u64,
        kind: LogKind,
        off: u64,
        bytes: Vec<u8>,
    },
    /// Deletes a segment (the core's `SsdFree`, after GC).
    Delete { seg: u64 },
}

impl IoOp {
    /// Bytes the operation moves (what the token bucket charges).
    pub fn bytes(&self) -> u64 {
        match self {
            IoOp::Read { len, .. } => *len as u64,
            IoOp::Write { bytes, .. } => bytes.len() as u64,
            IoOp::Delete { .. } => 0,
        }
    }
}

#[derive(Debug)]
pub struct IoRequest {
    /// The caller's tag, returned in the completion.
    pub id: u64,
    pub class: IoClass,
    pub op: IoOp,
}

#[derive(Debug)]
pub enum IoOutput {
    Read(AlignedBuf),
    Written,
    Deleted,
}

#[derive(Debug)]
pub struct IoCompletion {
    pub id: u64,
    pub class: IoClass,
    pub result: Result<IoOutput, SsdError>,
    /// From submission to the start of service.
    pub queued: Duration,
    /// The I/O itself.
    pub service: Duration,
}

/// Scheduler configuration.
#[derive(Clone, Debug)]
pub struct IoConfig {
    /// Worker threads: the most requests at the disk at once.
    pub workers: usize,
    /// Most requests of each class (indexed by `IoClass as usize`) at the disk at once.
    pub in_flight_max: [usize; 4],
    /// BatchPull's token bucket rate; `None` = unthrottled.
    pub batch_pull_bytes_per_s: Option<u64>,
    /// The bucket's depth: the largest burst of BatchPull bytes.
    pub batch_pull_burst_bytes: u64,
    /// Capacity of the request (and control) channel.
    pub request_channel_max: usize,
    /// Capacity of the completion channel; a consumer that does not drain it stalls the pool.
    pub completion_channel_max: usize,
    /// Requests held in the class queues; the feeder stops taking from the channel beyond this.
    pub queued_requests_max: usize,
}

impl Default for IoConfig {
    fn default() -> Self {
        IoConfig {
            workers: 4,
            in_flight_max: [4, 2, 2, 1],
            batch_pull_bytes_per_s: None,
            batch_pull_burst_bytes: 1 << 20,
            request_channel_max: 1024,
            completion_channel_max: 1024,
            queued_requests_max: 4096,
        }
    }
}

enum Msg {
    Req(IoRequest, Instant),
    Pause(IoClass),
    ResumeAll,
    Resume(IoClass),
    SetRate(Option<u64>),
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

struct Sched {
    queues: [VecDeque<(IoRequest, Instant)>; 4],
    in_flight: [usize; 4],
    in_flight_peak: [usize; 4],
    paused: [bool; 4],
    rate: Option<u64>,
    bucket: Bucket,
    shutdown: bool,
}

impl Sched {
    fn queued(&self) -> usize {
        self.queues.iter().map(|q| q.len()).sum()
    }

    /// Whether some queued request is of a class that is not paused.
    fn runnable(&self) -> bool {
        (0..4).any(|i| !self.paused[i] && !self.queues[i].is_empty())
    }

    fn refill(&mut self, burst: u64, now: Instant) {
        if let Some(rate) = self.rate {
            let dt = now.saturating_duration_since(self.bucket.at).as_secs_f64();
            self.bucket.tokens = (self.bucket.tokens + dt * rate as f64).min(burst as f64);
        }
        self.bucket.at = now;
    }

    /// The next request to start, or how long until the bucket could admit one (if that is
    /// all that holds work back).
    fn pick(
        &mut self,
        cfg: &IoConfig,
        now: Instant,
    ) -> Result<(IoRequest, Instant), Option<Duration>> {
        self.refill(cfg.batch_pull_burst_bytes, now);
        let mut wait = None;
        for c in CLASSES {
            let i = c as usize;
            if self.paused[i] || self.in_flight[i] >= cfg.in_flight_max[i] {
                continue;
            }
            let Some((front, _)) = self.queues[i].front() else {
                continue;
            };
            if c == IoClass::BatchPull {
                if let Some(rate) = self.rate {
                    // A request larger than the bucket is admitted when the bucket is full and
                    // drives it negative: the long-run rate still holds.
                    let need = (front.op.bytes() as f64).min(cfg.batch_pull_burst_bytes as f64);
                    if self.bucket.tokens < need {
                        let secs = (need - self.bucket.tokens) / rate.max(1) as f64;
                        wait = Some(Duration::from_secs_f64(secs));
                        continue;
                    }
                    self.bucket.tokens -= front.op.bytes() as f64;
                }
            }
            let job = self.queues[i].pop_front().unwrap();
            self.in_flight[i] += 1;
            self.in_flight_peak[i] = self.in_flight_peak[i].max(self.in_flight[i]);
            return Ok(job);
        }
        Err(wait)
    }
}

struct Shared {
    cfg: IoConfig,
    st: Mutex<Sched>,
    /// Signalled when work arrives, a request finishes, or the configuration changes.
    cv: Condvar,
}

/// The submitting side. Dropping every clone shuts the pool down after the queued work.
#[derive(Clone)]
pub struct IoSubmitter {
    tx: SyncSender<Msg>,
    shared: Arc<Shared>,
}

/// The pool's threads; [`IoPool::join`] waits for them after the submitters are dropped.
pub struct IoPool {
    threads: Vec<JoinHandle<()>>,
}

impl IoPool {
    /// Starts the pool over `logs`. Returns the submitter, the completion receiver and the pool.
    pub fn spawn(
        logs: Arc<SsdLogs>,
        cfg: IoConfig,
    ) -> (IoSubmitter, Receiver<IoCompletion>, IoPool) {
        assert!(cfg.workers > 0 && cfg.in_flight_max.iter().all(|m| *m > 0));
        let (tx, rx) = sync_channel::<Msg>(cfg.request_channel_max);
        let (done_tx, done_rx) = sync_channel::<IoCompletion>(cfg.completion_channel_max);
        let shared = Arc::new(Shared {
            st: Mutex::new(Sched {
                queues: Default::default(),
                in_flight: [0; 4],
                in_flight_peak: [0; 4],
                paused: [false; 4],
                rate: cfg.batch_pull_bytes_per_s,
                bucket: Bucket {
                    tokens: cfg.batch_pull_burst_bytes as f64,
                    at: Instant::now(),
                },
                shutdown: false,
            }),
            cv: Condvar::new(),
            cfg,
        });
        let mut threads = Vec::new();
        let sh = shared.clone();
        threads.push(
            std::thread::Builder::new()
                .name("ssd-io-feed".into())
                .spawn(move || feeder(rx, sh))
                .expect("spawn ssd-io-feed"),
        );
        for n in 0..shared.cfg.workers {
            let (sh, logs, done) = (shared.clone(), logs.clone(), done_tx.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("ssd-io-{n}"))
                    .spawn(move || worker(sh, logs, done))
                    .expect("spawn ssd-io worker"),
            );
        }
        (IoSubmitter { tx, shared }, done_rx, IoPool { threads })
    }

    pub fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// The submitter is gone (the pool has shut down).
#[derive(Debug, thiserror::Error)]
#[error("the SSD I/O pool has shut down")]
pub struct PoolGone;

impl IoSubmitter {
    /// Queues a request, blocking while the request channel is full (from async code use
    /// [`IoSubmitter::try_submit`] or `spawn_blocking`: this blocks the thread).
    pub fn submit(&self, req: IoRequest) -> Result<(), PoolGone> {
        self.tx
            .send(Msg::Req(req, Instant::now()))
            .map_err(|_| PoolGone)
    }

    /// Queues a request unless the request channel is full; then returns it.
    pub fn try_submit(&self, req: IoRequest) -> Result<(), IoRequest> {
        match self.tx.try_send(Msg::Req(req, Instant::now())) {
            Ok(()) => Ok(()),
            Err(
                TrySendError::Full(Msg::Req(r, _)) | TrySendError::Disconnected(Msg::Req(r, _)),
            ) => Err(r),
            Err(_) => unreachable!("only requests are sent here"),
        }
    }

    /// Starts no more requests of `class` until resumed (queued ones wait). The backup pauses
    /// GC during a proactive pull and live recovery (§5.1, §5.3).
    pub fn pause(&self, class: IoClass) -> Result<(), PoolGone> {
        self.tx.send(Msg::Pause(class)).map_err(|_| PoolGone)
    }

    pub fn resume(&self, class: IoClass) -> Result<(), PoolGone> {
        self.tx.send(Msg::Resume(class)).map_err(|_| PoolGone)
    }

    /// Resumes every class at once: what was queued while paused starts in priority order.
    pub fn resume_all(&self) -> Result<(), PoolGone> {
        self.tx.send(Msg::ResumeAll).map_err(|_| PoolGone)
    }

    /// Changes BatchPull's rate (`None` = unthrottled), e.g. from an adaptive controller.
    pub fn set_batch_pull_rate(&self, bytes_per_s: Option<u64>) -> Result<(), PoolGone> {
        self.tx
            .send(Msg::SetRate(bytes_per_s))
            .map_err(|_| PoolGone)
    }

    /// The most requests of each class seen at the disk at once (for tests and metrics).
    pub fn in_flight_peak(&self) -> [usize; 4] {
        self.shared.st.lock().unwrap().in_flight_peak
    }

    /// Requests waiting in the class queues.
    pub fn queued(&self) -> usize {
        self.shared.st.lock().unwrap().queued()
    }
}

fn feeder(rx: Receiver<Msg>, sh: Arc<Shared>) {
    for msg in rx.iter() {
        let mut st = sh.st.lock().unwrap();
        match msg {
            Msg::Req(req, at) => {
                // Wait for room only while something queued can run: if every queued request
                // is of a paused class, waiting would also hold back the Resume behind this
                // request in the channel (a deadlock), so the bound gives way instead.
                while st.queued() >= sh.cfg.queued_requests_max && st.runnable() {
                    st = sh.cv.wait(st).unwrap();
                }
                st.queues[req.class as usize].push_back((req, at));
            }
            Msg::Pause(c) => st.paused[c as usize] = true,
            Msg::Resume(c) => st.paused[c as usize] = false,
            Msg::ResumeAll => st.paused = [false; 4],
            Msg::SetRate(r) => {
                let now = Instant::now();
                st.refill(sh.cfg.batch_pull_burst_bytes, now);
                st.rate = r;
            }
        }
        drop(st);
        sh.cv.notify_all();
    }
    sh.st.lock().unwrap().shutdown = true;
    sh.cv.notify_all();
}

fn worker(sh: Arc<Shared>, logs: Arc<SsdLogs>, done: SyncSender<IoCompletion>) {
    loop {
        let (req, submitted) = {
            let mut st = sh.st.lock().unwrap();
            loop {
                match st.pick(&sh.cfg, Instant::now()) {
                    Ok(job) => break job,
                    Err(wait) => {
                        if st.shutdown && !st.runnable() {
                            // Work of a class still paused at shutdown is dropped.
                            return;
                        }
                        st = match wait {
                            Some(d) => sh.cv.wait_timeout(st, d).unwrap().0,
                            None => sh.cv.wait(st).unwrap(),
                        };
                    }
                }
            }
        };
        let start = Instant::now();
        let result = match req.op {
            IoOp::Read { seg, off, len } => logs.read_raw(seg, off, len).map(IoOutput::Read),
            IoOp::Write {
                seg,
                kind,
                off,
                bytes,
            } => logs
                .write_at(seg, kind, off, &bytes)
                .map(|()| IoOutput::Written),
            IoOp::Delete { seg } => logs.delete_segment(seg).map(|()| IoOutput::Deleted),
        };
        let service = start.elapsed();
        sh.st.lock().unwrap().in_flight[req.class as usize] -= 1;
        sh.cv.notify_all();
        // A dropped receiver means nobody wants completions any more; the work is done anyway.
        let _ = done.send(IoCompletion {
            id: req.id,
            class: req.class,
            result,
            queued: start.saturating_duration_since(submitted),
            service,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::super::ssdlog::tests::disk_dir;
    use super::super::ssdlog::{decode_pages, Loc, LogTs, SsdConfig, SsdEntry};
    use super::*;

    /// Logs with one cold segment of `pages` full pages.
    fn logs_with(dir: &std::path::Path, pages: usize) -> (Arc<SsdLogs>, u64, Vec<Loc>) {
        let (logs, _) = SsdLogs::open(dir, SsdConfig::default()).unwrap();
        let es: Vec<SsdEntry> = (0..pages)
            .map(|i| SsdEntry {
                key: format!("k{i}").into_bytes(),
                ts: LogTs {
                    term: 1,
                    index: i as u64,
                },
                value: vec![i as u8; 4000],
            })
            .collect();
        let locs = logs.append(LogKind::Cold, &es).unwrap();
        let seg = logs.segments(LogKind::Cold)[0].0;
        (Arc::new(logs), seg, locs)
    }

    #[test]
    fn io_priority_pull_behind_batch_pulls_completes_first() {
        let d = disk_dir();
        let (logs, seg, locs) = logs_with(d.path(), 64);
        let cfg = IoConfig {
            workers: 1,
            ..Default::default()
        };
        let (sub, done, pool) = IoPool::spawn(logs, cfg);
        for c in CLASSES {
            sub.pause(c).unwrap();
        }
        for i in 0..60u64 {
            let op = IoOp::Read {
                seg,
                off: i * 4096,
                len: 4096,
            };
            sub.submit(IoRequest {
                id: i,
                class: IoClass::BatchPull,
                op,
            })
            .unwrap();
        }
        let gc = IoOp::Read {
            seg,
            off: 0,
            len: 8192,
        };
        sub.submit(IoRequest {
            id: 1000,
            class: IoClass::Gc,
            op: gc,
        })
        .unwrap();
        let (off, len) = locs[42].page_span();
        let op = IoOp::Read { seg, off, len };
        sub.submit(IoRequest {
            id: 999,
            class: IoClass::PriorityPull,
            op,
        })
        .unwrap();
        sub.resume_all().unwrap();
        let order: Vec<IoCompletion> = (0..62).map(|_| done.recv().unwrap()).collect();
        assert_eq!(order[0].id, 999, "the PriorityPull starts first");
        match &order[0].result {
            Ok(IoOutput::Read(b)) => {
                let p = decode_pages(seg, off, b).0;
                assert_eq!(p.len(), 1);
                assert_eq!(p[0].1.key(), Some(&b"k42"[..]));
            }
            r => panic!("{r:?}"),
        }
        // Then BatchPull in submission order, then GC last.
        let ids: Vec<u64> = order[1..].iter().map(|c| c.id).collect();
        assert_eq!(ids, (0..60).chain([1000]).collect::<Vec<_>>());
        assert!(order.iter().all(|c| c.result.is_ok()));
        drop(sub);
        pool.join();
    }

    #[test]
    fn io_in_flight_limits_per_class_hold() {
        let d = disk_dir();
        let (logs, seg, _) = logs_with(d.path(), 16);
        let cfg = IoConfig {
            workers: 4,
            in_flight_max: [4, 2, 1, 2],
            ..Default::default()
        };
        let (sub, done, pool) = IoPool::spawn(logs, cfg);
        for c in CLASSES {
            sub.pause(c).unwrap();
        }
        let mut n = 0;
        for class in [IoClass::BatchPull, IoClass::Gc, IoClass::PriorityPull] {
            for i in 0..40u64 {
                let op = IoOp::Read {
                    seg,
                    off: (i % 16) * 4096,
                    len: 4096,
                };
                sub.submit(IoRequest { id: n, class, op }).unwrap();
                n += 1;
            }
        }
        sub.resume_all().unwrap();
        for _ in 0..n {
            assert!(done.recv().unwrap().result.is_ok());
        }
        let peak = sub.in_flight_peak();
        assert_eq!(peak[IoClass::BatchPull as usize], 1, "{peak:?}");
        assert!(peak[IoClass::Gc as usize] <= 2, "{peak:?}");
        assert!(peak[IoClass::PriorityPull as usize] <= 4, "{peak:?}");
        drop(sub);
        pool.join();
    }

    #[test]
    fn io_batch_pull_token_bucket_bounds_the_rate_and_appends_work() {
        let d = disk_dir();
        let (logs, seg, _) = logs_with(d.path(), 8);
        // 400 KiB/s with a one-page bucket: 21 page reads need at least 20 pages of refill,
        // 0.2 s, however fast the disk (a loaded machine only makes it slower).
        let cfg = IoConfig {
            batch_pull_bytes_per_s: Some(400 * 1024),
            batch_pull_burst_bytes: 4096,
            ..Default::default()
        };
        let (sub, done, pool) = IoPool::spawn(logs.clone(), cfg);
        let t0 = Instant::now();
        for i in 0..21u64 {
            let op = IoOp::Read {
                seg,
                off: (i % 8) * 4096,
                len: 4096,
            };
            sub.submit(IoRequest {
                id: i,
                class: IoClass::BatchPull,
                op,
            })
            .unwrap();
        }
        for _ in 0..21 {
            assert!(done.recv().unwrap().result.is_ok());
        }
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(190), "{took:?}");
        // Unthrottled again, and writes go through the same pool.
        sub.set_batch_pull_rate(None).unwrap();
        let e = SsdEntry {
            key: b"w".to_vec(),
            ts: LogTs { term: 2, index: 1 },
            value: vec![7; 100],
        };
        let mut b = crate::witness::core::page::BatchBuilder::new(500, 0);
        let loc = b.push(&e.to_entry()).unwrap();
        let op = IoOp::Write {
            seg: 500,
            kind: LogKind::Hot,
            off: 0,
            bytes: b.finish().0,
        };
        sub.submit(IoRequest {
            id: 77,
            class: IoClass::Writeback,
            op,
        })
        .unwrap();
        let c = done.recv().unwrap();
        assert!(matches!(c.result, Ok(IoOutput::Written)), "{:?}", c.result);
        assert_eq!(logs.read_entry(loc).unwrap(), e.to_entry());
        // A request for a segment that does not exist completes with an error, not a panic.
        let op = IoOp::Read {
            seg: 4242,
            off: 0,
            len: 4096,
        };
        sub.submit(IoRequest {
            id: 78,
            class: IoClass::PriorityPull,
            op,
        })
        .unwrap();
        assert!(matches!(
            done.recv().unwrap().result,
            Err(SsdError::UnknownSegment(4242))
        ));
        drop(sub);
        pool.join();
    }

    /// More requests of a paused class than the queue bound: the Resume behind them in the
    /// channel still gets through (the bound gives way while nothing queued can run).
    #[test]
    fn io_queue_bound_does_not_deadlock_a_pause() {
        let d = disk_dir();
        let (logs, seg, _) = logs_with(d.path(), 4);
        let cfg = IoConfig {
            workers: 1,
            queued_requests_max: 8,
            request_channel_max: 4,
            ..Default::default()
        };
        let (sub, done, pool) = IoPool::spawn(logs, cfg);
        // Submitted from another thread, so a deadlock fails the test instead of hanging it.
        let feeder = {
            let sub = sub.clone();
            std::thread::spawn(move || {
                sub.pause(IoClass::Gc).unwrap();
                for i in 0..40u64 {
                    let op = IoOp::Read {
                        seg,
                        off: (i % 4) * 4096,
                        len: 4096,
                    };
                    sub.submit(IoRequest {
                        id: i,
                        class: IoClass::Gc,
                        op,
                    })
                    .unwrap();
                }
                sub.resume(IoClass::Gc).unwrap();
            })
        };
        let ids: Vec<u64> = (0..40)
            .map(|_| {
                done.recv_timeout(Duration::from_secs(30))
                    .expect("no deadlock")
                    .id
            })
            .collect();
        feeder.join().unwrap();
        assert_eq!(ids, (0..40).collect::<Vec<_>>());
        drop(sub);
        pool.join();
    }
}
