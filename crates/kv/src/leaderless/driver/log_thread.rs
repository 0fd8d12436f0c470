//! Persistence of a node: a dedicated thread owning the [`FileLog`] takes appends in order and
//! batches them (group commit), each batch one `O_DSYNC` write, or, when it is large or a sync
//! is in flight, written and synced by a second thread while the next batch is written (see
//! `Syncer`); each durable append is reported in order.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::leaderless::proto::*;
use crate::pmlog::{self, Append, FileLog};

use super::*;

pub(super) enum LogJob {
    /// Appends, in order, each with the (core incarnation, seq) to report once it is durable,
    /// or `None` for a lazy append (a GDP flag, an `Epoch` record). The core's outputs of one
    /// input go as one job; a catch-up chunk is one append, encoded here, off the core's thread.
    Append(Vec<(Option<(u64, u64)>, Append)>),
    /// Rebuild the state from the log; with `Some(node)`, replace the log with a new node's
    /// first (the full-copy baseline: [`FileLog::reset_as_new_node`]).
    Rebuild(std::sync::mpsc::Sender<pmlog::LogState>, Option<NodeId>),
    /// Reactive-log baseline: read the log at a cursor, after every append queued before.
    Read {
        to: NodeId,
        cursor: pmlog::LogCursor,
        max_bytes: usize,
    },
}

/// The log thread writes at most about this many bytes of queued appends per write (and sync):
/// large enough that a catch-up's many chunks cost few syncs, bounded so one write's latency
/// stays in the tens of milliseconds.
pub const MAX_LOG_BATCH_BYTES: usize = 32 << 20;

/// Sync jobs queued for the log's syncer thread at most (the log thread waits past it).
pub const LOG_SYNC_QUEUE_JOBS: usize = 1024;

/// The second half of a pipelined group commit: appends the log thread has written (and
/// started the write-back of) are made durable here, with one `fdatasync` for every job
/// queued by then, and reported in order, while the log thread encodes and writes the next
/// ones. Without it the log thread would wait for each sync (several milliseconds of device
/// flush) before writing what arrived meanwhile, which paced a catch-up's durable log.
pub(super) struct Syncer {
    tx: std::sync::mpsc::SyncSender<(std::fs::File, Vec<(u64, u64)>)>,
    /// Jobs sent and not yet reported.
    pending: Arc<(Mutex<usize>, std::sync::Condvar)>,
}

impl Syncer {
    fn spawn(inputs: mpsc::UnboundedSender<Input>, stats: Arc<NodeStats>, extra: Duration) -> Self {
        let (tx, rx) =
            std::sync::mpsc::sync_channel::<(std::fs::File, Vec<(u64, u64)>)>(LOG_SYNC_QUEUE_JOBS);
        let pending = Arc::new((Mutex::new(0usize), std::sync::Condvar::new()));
        let p = pending.clone();
        std::thread::Builder::new()
            .name("kv-log-sync".into())
            .spawn(move || {
                // Ends when the log thread drops the sender.
                while let Ok((mut file, mut seqs)) = rx.recv() {
                    let mut jobs = 1;
                    // Every queued job was written before it was queued: one sync covers all.
                    while let Ok((f, s)) = rx.try_recv() {
                        file = f;
                        seqs.extend(s);
                        jobs += 1;
                    }
                    let t = Instant::now();
                    if let Err(e) = file.sync_data() {
                        // A node that cannot persist must not acknowledge anything: stop it.
                        tracing::error!("log sync failed: {e}; stopping");
                        eprintln!("error: persistent log sync failed: {e}");
                        std::process::exit(2);
                    }
                    if !extra.is_zero() {
                        std::thread::sleep(extra);
                    }
                    stats.log_durable_writes.fetch_add(1, Ordering::Relaxed);
                    add_us(&stats.log_durable_us, t);
                    let _ = inputs.send(Input::Persisted(seqs));
                    let (n, cv) = &*p;
                    *n.lock().unwrap() -= jobs;
                    cv.notify_all();
                }
            })
            .expect("spawning the log sync thread");
        Syncer { tx, pending }
    }

    fn idle(&self) -> bool {
        *self.pending.0.lock().unwrap() == 0
    }

    fn send(&self, file: std::fs::File, seqs: Vec<(u64, u64)>) {
        *self.pending.0.lock().unwrap() += 1;
        if self.tx.send((file, seqs)).is_err() {
            *self.pending.0.lock().unwrap() -= 1;
        }
    }

    /// Waits until every job sent is durable and reported.
    fn drain(&self) {
        let (n, cv) = &*self.pending;
        let mut n = n.lock().unwrap();
        while *n > 0 {
            n = cv.wait(n).unwrap();
        }
    }
}

/// Starts the log thread over `flog`; returns its job queue. The thread's loop (about 140
/// lines) is one batch's life: gather queued jobs up to [`MAX_LOG_BATCH_BYTES`], encode, write
/// (or hand to the [`Syncer`]), report; kept in one place because every step shares the batch.
pub(super) fn spawn_log_thread(
    mut flog: FileLog,
    inputs: mpsc::UnboundedSender<Input>,
    stats: Arc<NodeStats>,
) -> std::sync::mpsc::Sender<LogJob> {
    let (tx, rx) = std::sync::mpsc::channel::<LogJob>();
    let syncer = Syncer::spawn(inputs.clone(), stats.clone(), flog.extra_persist_latency());
    std::thread::Builder::new()
        .name("kv-log".into())
        .spawn(move || {
            while let Ok(first) = rx.recv() {
                let mut batch = vec![first];
                let mut bytes = 0usize;
                let job_bytes = |j: &LogJob| match j {
                    LogJob::Append(v) => v.iter().map(|(_, r)| r.size_hint()).sum(),
                    _ => 0,
                };
                bytes += job_bytes(&batch[0]);
                while bytes < MAX_LOG_BATCH_BYTES {
                    let Ok(j) = rx.try_recv() else { break };
                    bytes += job_bytes(&j);
                    batch.push(j);
                }
                let mut recs = Vec::new();
                let mut seqs = Vec::new();
                let mut reads = Vec::new();
                let mut log_reads = Vec::new();
                for j in batch {
                    match j {
                        LogJob::Append(v) => {
                            for (done, r) in v {
                                if let Some(d) = done {
                                    seqs.push(d);
                                }
                                recs.push(r);
                            }
                        }
                        LogJob::Rebuild(reply, as_new) => reads.push((reply, as_new)),
                        LogJob::Read {
                            to,
                            cursor,
                            max_bytes,
                        } => log_reads.push((to, cursor, max_bytes)),
                    }
                }
                // A small batch with nothing being synced is one `O_DSYNC` write, here (the
                // shortest wait); any other durable batch is written and handed to the syncer
                // (behind what it is syncing: completions stay in log order).
                let alone = syncer.idle() && bytes <= pmlog::DSYNC_WRITE_MAX_BYTES;
                let res = if recs.is_empty() {
                    Ok(())
                } else if seqs.is_empty() {
                    flog.append_items_lazy(&recs)
                } else {
                    let (t, len0, enc0) = (Instant::now(), flog.len_bytes(), flog.encode_us);
                    let r = if alone {
                        flog.append_items_durable(&recs)
                    } else {
                        flog.append_items_written(&recs)
                    };
                    stats
                        .log_encode_us
                        .fetch_add(flog.encode_us - enc0, Ordering::Relaxed);
                    stats
                        .log_durable_bytes
                        .fetch_add(flog.len_bytes() - len0, Ordering::Relaxed);
                    if alone {
                        stats.log_durable_writes.fetch_add(1, Ordering::Relaxed);
                    }
                    add_us(&stats.log_durable_us, t);
                    r
                };
                if let Err(e) = res {
                    // A node that cannot persist must not acknowledge anything: stop it.
                    tracing::error!("log append failed: {e}; stopping");
                    eprintln!("error: persistent log append failed: {e}");
                    std::process::exit(2);
                }
                if !seqs.is_empty() {
                    if alone {
                        if inputs.send(Input::Persisted(seqs)).is_err() {
                            return;
                        }
                    } else {
                        match flog.sync_handle() {
                            Ok(f) => syncer.send(f, seqs),
                            Err(e) => {
                                tracing::error!("log sync handle: {e}; stopping");
                                eprintln!("error: persistent log sync handle: {e}");
                                std::process::exit(2);
                            }
                        }
                    }
                }
                // A rebuild and a compaction see a log whose appends are all durable (and a
                // compaction replaces the file the syncer's handles refer to). A log read of
                // the reactive baseline does not wait for the sync: it reads every append
                // written before it (from the page cache), and what it sends is judged
                // against the store, not against this log's durability.
                if !reads.is_empty() || flog.wants_compaction() {
                    syncer.drain();
                }
                for (r, as_new) in reads {
                    let st = match as_new {
                        Some(node) => flog.reset_as_new_node(node),
                        None => flog.rebuild_state(),
                    };
                    match st {
                        Ok(st) => {
                            let _ = r.send(st);
                        }
                        Err(e) => {
                            // A default state would make the node a fresh member: stop it.
                            tracing::error!("rebuilding the log: {e}; stopping");
                            eprintln!("error: rebuilding the persistent log failed: {e}");
                            std::process::exit(2);
                        }
                    }
                }
                // Reads see every append queued before them (they were written just above).
                for (to, cursor, max_bytes) in log_reads {
                    match flog.read_chunk(&cursor, max_bytes) {
                        Ok(chunk) => {
                            if inputs.send(Input::LogRead { to, cursor, chunk }).is_err() {
                                return;
                            }
                        }
                        Err(e) => tracing::warn!("reading the log for node {to}: {e}"),
                    }
                }
                match flog.maybe_compact() {
                    Ok(true) => tracing::info!(bytes = flog.len_bytes(), "log compacted"),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::error!("log compaction failed: {e}; stopping");
                        eprintln!("error: persistent log compaction failed: {e}");
                        std::process::exit(2);
                    }
                }
                stats.log_bytes.store(flog.len_bytes(), Ordering::Relaxed);
                stats
                    .log_compactions
                    .store(flog.compactions, Ordering::Relaxed);
            }
        })
        .expect("spawning the log thread");
    tx
}
