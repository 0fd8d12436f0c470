//! The replication state: one [`Shim`] per process under one [`ForkLock`] ([`SHIM`]), its
//! open log files ([`Tracked`]), connections to the peers and the controller, and the pump that
//! drives every [`FileClient`] over blocking sockets.

use super::*;

pub(super) struct Tracked {
    pub(super) key: String,
    pub(super) client: FileClient,
    /// A read-only fd on the same file (the application's may be write-only), for resyncs.
    pub(super) read_fd: c_int,
    /// The epoch this writer owns the file at (its open, or its last resume/relocation); a
    /// mover's newer epoch does not take ownership, so after being fenced by one we resume.
    pub(super) owner_epoch: u64,
    /// A resume in progress: ops not acknowledged in the old epoch (resubmitted once the new
    /// epoch is ready) and the replicated size after them.
    pub(super) resume: Option<(Vec<Op>, u64)>,
    /// Resumes and relocations so far in this wait (bounded: no endless ping-pong).
    pub(super) resumes: u32,
}

/// Default of `UNDERSTUDY_NEARLOG_DEFER_US` ([`Config::defer`]).
pub(super) const DEFAULT_DEFER_US: u64 = 1_000;
/// Largest `UNDERSTUDY_NEARLOG_DEFER_US`: how far the peers beyond the majority may lag.
pub(super) const MAX_DEFER_US: u64 = 100_000;
/// Most bytes queued for one peer connection that its socket has not taken yet (an image
/// staged to a lagging peer is up to a file's size); past it the connection is dropped.
pub(super) const MAX_QUEUED_SEND_BYTES: usize = 512 << 20;
/// A send queue keeps at most this much capacity once drained (and drops its sent front past it).
pub(super) const SENDQ_KEEP_BYTES: usize = 1 << 20;

/// Counters of the write path, printed to stderr every [`STATS_EVERY_WRITES`] replicated writes
/// when `UNDERSTUDY_NEARLOG_STATS=1` (where a write's time goes: system calls, polls, waits).
pub(super) mod stats {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    pub static WRITES: AtomicU64 = AtomicU64::new(0);
    pub static BYTES: AtomicU64 = AtomicU64::new(0);
    /// Wall time inside `replicate` (local write excluded), ns.
    pub static REPLICATE_NS: AtomicU64 = AtomicU64::new(0);
    /// Wall time from the sends of a pump to a reply being readable, ns.
    pub static WAIT_NS: AtomicU64 = AtomicU64::new(0);
    /// Wall time of a pump's sends, ns.
    pub static SEND_NS: AtomicU64 = AtomicU64::new(0);
    pub static PUMPS: AtomicU64 = AtomicU64::new(0);
    pub static POLLS: AtomicU64 = AtomicU64::new(0);
    pub static YIELDS: AtomicU64 = AtomicU64::new(0);
    pub static BLOCKING_POLLS: AtomicU64 = AtomicU64::new(0);
    pub static SENDS: AtomicU64 = AtomicU64::new(0);
    pub static READS: AtomicU64 = AtomicU64::new(0);
    pub static REPLIES: AtomicU64 = AtomicU64::new(0);
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }
    pub fn enabled() -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var("UNDERSTUDY_NEARLOG_STATS").is_ok_and(|v| v == "1"))
    }
    pub fn line() -> String {
        let w = WRITES.load(Relaxed).max(1) as f64;
        let per = |c: &AtomicU64| c.load(Relaxed) as f64 / w;
        format!(
            "stats: {} writes, {:.0} B/write; per write: replicate {:.1} us, sends {:.1} us, wait {:.1} us, pumps {:.2}, polls {:.2} (blocking {:.3}), yields {:.2}, sends {:.2}, reads {:.2}, replies {:.2}",
            WRITES.load(Relaxed),
            per(&BYTES),
            per(&REPLICATE_NS) / 1000.0,
            per(&SEND_NS) / 1000.0,
            per(&WAIT_NS) / 1000.0,
            per(&PUMPS),
            per(&POLLS),
            per(&BLOCKING_POLLS),
            per(&YIELDS),
            per(&SENDS),
            per(&READS),
            per(&REPLIES)
        )
    }
}
/// See [`stats`].
pub(super) const STATS_EVERY_WRITES: u64 = 2_000;

/// Resumes or relocations one wait may go through before it gives up with EIO.
pub(super) const MAX_RESUMES_PER_WAIT: u32 = 8;

thread_local! {
    /// errno of the last failed log operation on this thread (EIO unless a region was full
    /// everywhere: ENOSPC).
    pub(super) static FAIL_ERRNO: Cell<c_int> = const { Cell::new(libc::EIO) };
}

pub(super) fn take_fail_errno() -> c_int {
    FAIL_ERRNO.with(|e| e.replace(libc::EIO))
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if self.read_fd >= 0 {
            // SAFETY: our own fd, closed once.
            unsafe { close_own(self.read_fd) };
        }
    }
}

/// A read-only fd on the file behind `fd`.
pub(super) fn reopen_readonly(fd: c_int) -> Result<c_int, String> {
    let p = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).unwrap();
    // SAFETY: real openat on a valid C string.
    let r = unsafe { (real().openat)(libc::AT_FDCWD, p.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC, 0) };
    if r < 0 {
        return Err(format!("cannot reopen fd {fd} for reading: {}", std::io::Error::last_os_error()));
    }
    OWN_FDS.set(r, true);
    Ok(r)
}

pub(super) struct Shim {
    pub(super) cfg: Config,
    pub(super) peers: HashMap<PeerId, (String, Option<blocking::Conn>, Instant)>,
    pub(super) files: HashMap<c_int, Tracked>,
    /// dup/dup2/dup3/F_DUPFD copies of log fds -> the fd their `Tracked` is filed under (they
    /// share the open file description, so one replication state serves them all).
    pub(super) aliases: HashMap<c_int, c_int>,
    /// Reply buffers of the peer connections (reset with each new connection).
    pub(super) readers: HashMap<PeerId, blocking::FrameReader>,
    /// Bytes held back for the peers beyond a majority (see [`Shim::pump`]), and since when.
    pub(super) deferred: HashMap<PeerId, (Vec<u8>, Instant)>,
    /// Per peer: when the oldest unanswered batch went out, and a moving average of the time
    /// to its first reply (µs): the quickest majority is sent to first.
    pub(super) reply_us: HashMap<PeerId, (Option<Instant>, u64)>,
    /// Per peer: bytes handed to its connection that the kernel has not taken yet, and how many
    /// of them went out. Sends never block the application: a large transfer to one peer (the
    /// image staged to a peer that lags after a crash, a resync) goes out as its socket drains,
    /// during later pumps, while the majority's small records pass on their own connections.
    pub(super) sendq: HashMap<PeerId, (Vec<u8>, usize)>,
    /// Per peer whose last dial failed: how long to wait before the next (see
    /// [`Shim::ensure_conn`]).
    pub(super) redial_after: HashMap<PeerId, Duration>,
    pub(super) start: Instant,
}

/// How long a dial of a log peer may block the application's thread when it is optimistic:
/// while a majority of the known peers is connected (writes go on through them without this
/// one), or for a peer's first dial in this process (a fresh reader must not wait seconds on
/// a dead peer dialled first; if a live one was just slow, its next dial is patient). A host
/// that does not answer (dead or cut off; it sends no reset) costs the whole timeout: it cost
/// 2 s per dial (issue 24). Hundreds of times a connect and handshake on a live host.
pub(super) const PEER_CONNECT_TIMEOUT_OPTIMISTIC: Duration = Duration::from_millis(300);
/// How long a dial of a log peer may take otherwise (its last dial failed and no majority is
/// connected): nothing proceeds without it, and a loaded machine's slow handshake must not
/// fail the application.
pub(super) const PEER_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The connect timeout for a dial of one of `known` log peers while `connected` of them have a
/// connection (the dialled one has none); `failed_before`: its last dial failed.
pub(super) fn peer_connect_timeout(connected: usize, known: usize, failed_before: bool) -> Duration {
    if 2 * connected > known || !failed_before {
        PEER_CONNECT_TIMEOUT_OPTIMISTIC
    } else {
        PEER_CONNECT_TIMEOUT
    }
}

/// The shortest wait before a peer whose dial failed is dialled again.
pub(super) const MIN_REDIAL_WAIT: Duration = Duration::from_millis(200);
/// After a failed dial, a peer is dialled again no sooner than this many times as long as the
/// attempt took (at least [`MIN_REDIAL_WAIT`]). A port that refuses answers at once and is
/// tried again soon; a host that does not answer at all (dead, or cut off) costs the
/// application's thread the whole connect timeout per dial, and dialled every 200 ms it took
/// nearly all of that thread's time: an open then could not finish within its deadline on the
/// live majority.
pub(super) const REDIAL_WAIT_PER_ATTEMPT: u32 = 4;

/// The replication state: one lock, held across replication round trips. A fork's child
/// replaces it ([`after_fork_child`]). Take it with [`lock_state`].
pub(super) static SHIM: ForkLock<Option<Shim>> = ForkLock::new(None);

/// Locks the state, first forgetting the log fds a signal handler closed meanwhile
/// ([`PENDING_FORGET`]).
pub(super) fn lock_state() -> crate::forklock::ForkGuard<'static, Option<Shim>> {
    let mut slot = SHIM.lock();
    if ANY_PENDING.swap(false, Ordering::Acquire) {
        for w in 0..MAX_TRACKED_FD / 64 {
            let mut bits = PENDING_FORGET.0[w].swap(0, Ordering::Acquire);
            while bits != 0 {
                let fd = (w * 64 + bits.trailing_zeros() as usize) as c_int;
                bits &= bits - 1;
                if let Some(shim) = slot.as_mut() {
                    forget_locked(shim, fd);
                }
            }
        }
    }
    slot
}

impl Shim {
    pub(super) fn get(slot: &mut Option<Shim>) -> Result<&mut Shim, String> {
        if slot.is_none() {
            let cfg = load_config()?;
            *slot = Some(Shim {
                cfg,
                peers: HashMap::new(),
                files: HashMap::new(),
                aliases: HashMap::new(),
                readers: HashMap::new(),
                deferred: HashMap::new(),
                reply_us: HashMap::new(),
                sendq: HashMap::new(),
                redial_after: HashMap::new(),
                start: Instant::now(),
            });
        }
        Ok(slot.as_mut().unwrap())
    }

    pub(super) fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    pub(super) fn ctl(&mut self, req: &CtlRequest) -> Result<CtlReply, String> {
        let mut s = blocking::connect_any(&self.cfg.controller, &self.cfg.secret, Duration::from_secs(5)).map_err(|e| format!("controller {}: {e}", self.cfg.controller))?;
        let rep: CtlReply = blocking::call(&mut s, req, MAX_FRAME_BYTES).map_err(|e| format!("controller {}: {e}", self.cfg.controller))?;
        if let CtlReply::Error(e) = &rep {
            return Err(format!("controller refused {req:?}: {e}"));
        }
        Ok(rep)
    }

    pub(super) fn ensure_conn(&mut self, peer: PeerId) -> Option<&mut blocking::Conn> {
        let secret = &self.cfg.secret;
        let connected = self.peers.values().filter(|v| v.1.is_some()).count();
        let timeout = peer_connect_timeout(connected, self.peers.len(), self.redial_after.contains_key(&peer));
        let (addr, conn, last_try) = self.peers.get_mut(&peer)?;
        let wait = self.redial_after.get(&peer).copied().unwrap_or(MIN_REDIAL_WAIT);
        if conn.is_none() && last_try.elapsed() >= wait {
            *last_try = Instant::now();
            match blocking::connect(addr, secret, timeout) {
                Ok(s) => {
                    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                    OWN_FDS.set(s.as_raw_fd(), true);
                    *conn = Some(s);
                    self.readers.remove(&peer);
                    self.sendq.remove(&peer);
                    self.redial_after.remove(&peer);
                }
                Err(e) => {
                    let next = (last_try.elapsed() * REDIAL_WAIT_PER_ATTEMPT).max(MIN_REDIAL_WAIT);
                    self.redial_after.insert(peer, next);
                    log(&format!("log peer {peer} at {addr} unreachable: {e} (next try in {} ms)", next.as_millis()));
                }
            }
        }
        conn.as_mut()
    }

    /// Sends every file's outgoing messages, reads replies for up to `wait`, feeds them in.
    ///
    /// A write needs acks from a majority, and every send to a peer costs the application's
    /// thread a system call (on loopback, the whole TCP receive path) and the peer a wake-up on
    /// the same few cores. So when a batch goes to three or more connected peers, the quickest
    /// majority (by recent reply times) gets it at once and the others' bytes are held back:
    /// they ride along with the next batch to that peer, or go out once held for
    /// [`Config::defer`] (also while a call waits: a slow majority never waits on a held-back
    /// peer for longer), or at close. Durability is unchanged (a call returns once a majority
    /// holds its ops); the peers beyond it lag by at most `defer` of records.
    pub(super) fn pump(&mut self, wait: Duration) {
        stats::add(&stats::PUMPS, 1);
        let mut batches = self.collect_batches();
        let at = Instant::now();
        self.defer_slow_peers(&mut batches, at);
        let sending = Instant::now();
        for (p, buf) in batches {
            self.send_batch(p, &buf, at);
        }
        stats::add(&stats::SEND_NS, sending.elapsed().as_nanos() as u64);
        // Wait for replies on every connected peer (not past the time a held batch is due).
        let wait = if self.deferred.is_empty() { wait } else { wait.min(self.cfg.defer) };
        let ids: Vec<PeerId> = self.peers.iter().filter(|(_, v)| v.1.is_some()).map(|(k, _)| *k).collect();
        if ids.is_empty() {
            std::thread::sleep(wait.min(Duration::from_millis(20)));
            return;
        }
        // Queued output (a transfer larger than the socket takes at once) goes on as it drains.
        for p in &ids {
            if self.has_queued(p) {
                self.try_send(*p);
            }
        }
        let ids: Vec<PeerId> = self.peers.iter().filter(|(_, v)| v.1.is_some()).map(|(k, _)| *k).collect();
        if ids.is_empty() {
            return;
        }
        let mut fds: Vec<libc::pollfd> = ids
            .iter()
            .map(|p| {
                let out = if self.has_queued(p) { libc::POLLOUT } else { 0 };
                libc::pollfd { fd: self.peers[p].1.as_ref().unwrap().as_raw_fd(), events: libc::POLLIN | out, revents: 0 }
            })
            .collect();
        let waited = Instant::now();
        let got = self.wait_replies(&mut fds, wait);
        stats::add(&stats::WAIT_NS, waited.elapsed().as_nanos() as u64);
        if !got {
            return;
        }
        for (i, p) in ids.iter().enumerate() {
            if fds[i].revents & libc::POLLOUT != 0 {
                self.try_send(*p);
            }
            if fds[i].revents & !libc::POLLOUT == 0 || self.peers.get(p).is_none_or(|v| v.1.is_none()) {
                continue;
            }
            self.receive_from(*p);
        }
    }

    /// Ticks every file's client and encodes what they have to send: one buffer per peer, so a
    /// batch goes out in one write.
    fn collect_batches(&mut self) -> HashMap<PeerId, Vec<u8>> {
        let now = self.now_us();
        let mut out: Vec<(PeerId, PeerRequest)> = Vec::new();
        for t in self.files.values_mut() {
            t.client.handle(Input::Tick { now_us: now });
            out.extend(t.client.take_outputs());
        }
        // A record goes to every peer alike (consecutive equal requests): it is encoded and
        // checksummed once.
        let mut batches: HashMap<PeerId, Vec<u8>> = HashMap::new();
        let mut prev: Option<PeerRequest> = None;
        let mut frame: Vec<u8> = Vec::new();
        for (p, req) in out {
            if prev.as_ref() != Some(&req) {
                frame.clear();
                let _ = blocking::encode_into(&req, &mut frame);
                prev = Some(req);
            }
            batches.entry(p).or_default().extend_from_slice(&frame);
        }
        batches
    }

    /// With three or more connected peers to send to, the slowest beyond a majority are held
    /// back (in `deferred`) until a batch of theirs waited `cfg.defer`.
    fn defer_slow_peers(&mut self, batches: &mut HashMap<PeerId, Vec<u8>>, at: Instant) {
        let fresh: Vec<PeerId> = batches.keys().copied().collect();
        let connected = |s: &Shim, p: &PeerId| s.peers.get(p).is_some_and(|v| v.1.is_some());
        let mut hold: Vec<PeerId> = Vec::new();
        if fresh.len() >= 3 && fresh.iter().all(|p| connected(self, p)) {
            let mut by_speed = fresh.clone();
            by_speed.sort_by_key(|p| (self.reply_us.get(p).map_or(0, |r| r.1), *p));
            hold = by_speed.split_off(fresh.len() / 2 + 1);
        }
        // Held-back bytes go first on their connection (per-peer order is kept); a peer with
        // nothing new is sent what it was held once that waited long enough.
        for (p, (held, since)) in std::mem::take(&mut self.deferred) {
            let due = at.duration_since(since) >= self.cfg.defer;
            match batches.remove(&p) {
                Some(b) if !hold.contains(&p) || due => {
                    let mut all = held;
                    all.extend_from_slice(&b);
                    batches.insert(p, all);
                    hold.retain(|&h| h != p);
                }
                Some(b) => {
                    let mut all = held;
                    all.extend_from_slice(&b);
                    self.deferred.insert(p, (all, since));
                }
                None if due => {
                    batches.insert(p, held);
                }
                None => {
                    self.deferred.insert(p, (held, since));
                }
            }
        }
        for p in hold {
            if let Some(b) = batches.remove(&p) {
                if let Some((held, _)) = self.deferred.get_mut(&p) {
                    held.extend_from_slice(&b);
                } else {
                    self.deferred.insert(p, (b, at));
                }
            }
        }
    }

    /// Reads every reply one peer's connection has and gives each to the files' clients; a
    /// closed or broken connection is dropped.
    fn receive_from(&mut self, p: PeerId) {
        // One read takes every reply the kernel has; they are parsed from the buffer.
        let conn = self.peers.get_mut(&p).unwrap().1.as_mut().unwrap();
        let reader = self.readers.entry(p).or_default();
        let mut replies = Vec::new();
        stats::add(&stats::READS, 1);
        let mut lost;
        loop {
            lost = match reader.fill(conn) {
                Ok(0) => Some("connection closed".to_string()),
                // TLS: the bytes completed no record yet (they wait in the session).
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && conn.is_tls() => None,
                Ok(_) => None,
                Err(e) => Some(e.to_string()),
            };
            while lost.is_none() {
                match reader.next::<PeerReply>(MAX_FRAME_BYTES) {
                    Ok(Some(rep)) => replies.push(rep),
                    Ok(None) => break,
                    Err(e) => lost = Some(e.to_string()),
                }
            }
            // Replies a TLS session decrypted beyond what the buffer took do not show to poll:
            // they are taken now.
            if lost.is_some() || conn.buffered_plaintext() == 0 {
                break;
            }
        }
        if !replies.is_empty() {
            if let Some(r) = self.reply_us.get_mut(&p) {
                if let Some(sent) = r.0.take() {
                    let us = sent.elapsed().as_micros() as u64;
                    r.1 = if r.1 == 0 { us } else { (r.1 * 7 + us) / 8 };
                }
            }
        }
        stats::add(&stats::REPLIES, replies.len() as u64);
        for rep in replies {
            if let Some(f) = rep.file() {
                for t in self.files.values_mut().filter(|t| t.client.file() == f) {
                    t.client.handle(Input::Reply { peer: p, reply: rep.clone() });
                }
            }
        }
        if let Some(e) = lost {
            log(&format!("log peer {p}: connection lost: {e}"));
            self.drop_conn(p);
        }
    }

    /// Waits until one of `fds` is readable or `wait` passed; false if none is.
    ///
    /// For the first [`Config::spin`] (`UNDERSTUDY_NEARLOG_SPIN_US`, default
    /// [`DEFAULT_SPIN_US`]) it polls without sleeping, yielding the CPU between polls: the
    /// replies of a majority usually come within that time, and a thread that sleeps pays a
    /// wake-up on their arrival (on a VM's vCPU an idle exit and an interrupt, the same order
    /// as the round trip itself). The yield lets a peer queued on this CPU (loopback) run at
    /// once instead of waiting for this thread's time slice to end. Past that, `poll` blocks: a
    /// slow or dead peer costs at most the spin, never a busy core.
    pub(super) fn wait_replies(&self, fds: &mut [libc::pollfd], wait: Duration) -> bool {
        let poll = |fds: &mut [libc::pollfd], ms: c_int| {
            stats::add(&stats::POLLS, 1);
            if ms != 0 {
                stats::add(&stats::BLOCKING_POLLS, 1);
            }
            // SAFETY: fds is a valid array of pollfd for the duration of the call.
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) > 0 }
        };
        let spin = self.cfg.spin.min(wait);
        if !spin.is_zero() {
            let until = Instant::now() + spin;
            loop {
                if poll(fds, 0) {
                    return true;
                }
                if Instant::now() >= until {
                    break;
                }
                stats::add(&stats::YIELDS, 1);
                // SAFETY: no arguments, no memory touched.
                unsafe { libc::sched_yield() };
            }
        }
        let left = wait.saturating_sub(spin);
        // Round up: a sub-millisecond wait must still wait (poll takes milliseconds).
        poll(fds, left.as_micros().div_ceil(1000) as c_int)
    }

    pub(super) fn send_batch(&mut self, p: PeerId, buf: &[u8], at: Instant) {
        if self.ensure_conn(p).is_none() {
            return;
        }
        let q = self.sendq.entry(p).or_default();
        if q.0.len() - q.1 + buf.len() > MAX_QUEUED_SEND_BYTES {
            // A peer that takes nothing for this long is as good as gone: the client's own
            // retransmission and resync bring it back on a new connection.
            log(&format!("log peer {p}: more than {MAX_QUEUED_SEND_BYTES} bytes not taken; dropping the connection"));
            self.drop_conn(p);
            return;
        }
        q.0.extend_from_slice(buf);
        self.try_send(p);
        let r = self.reply_us.entry(p).or_insert((None, 0));
        r.0.get_or_insert(at);
    }

    /// Writes what the kernel takes of peer `p`'s queue without blocking.
    pub(super) fn try_send(&mut self, p: PeerId) {
        let Some(conn) = self.peers.get_mut(&p).and_then(|v| v.1.as_mut()) else { return };
        let Some(q) = self.sendq.get_mut(&p) else { return };
        let mut failed = None;
        if q.1 < q.0.len() || conn.tls_pending() {
            stats::add(&stats::SENDS, 1);
            match conn.send_ready(&q.0[q.1..]) {
                Ok(n) => q.1 += n,
                Err(e) => failed = Some(e),
            }
        }
        if q.1 == q.0.len() {
            q.0.clear();
            q.1 = 0;
            if q.0.capacity() > SENDQ_KEEP_BYTES {
                q.0 = Vec::new();
            }
        } else if q.1 >= SENDQ_KEEP_BYTES && q.1 * 2 >= q.0.len() {
            // Do not keep the sent front of a long transfer resident (moved at most once per halving).
            q.0.drain(..q.1);
            q.1 = 0;
        }
        if let Some(e) = failed {
            log(&format!("log peer {p}: send failed: {e}"));
            self.drop_conn(p);
        }
    }

    /// Bytes for peer `p` wait to go out: in its queue, or encrypted in its TLS session.
    pub(super) fn has_queued(&self, p: &PeerId) -> bool {
        self.sendq.get(p).is_some_and(|q| q.1 < q.0.len()) || self.peers.get(p).and_then(|v| v.1.as_ref()).is_some_and(|c| c.tls_pending())
    }

    pub(super) fn drop_conn(&mut self, p: PeerId) {
        if let Some(v) = self.peers.get_mut(&p) {
            if let Some(c) = &v.1 {
                OWN_FDS.set(c.as_raw_fd(), false); // before the close: see OWN_FDS
            }
            v.1 = None;
        }
        self.readers.remove(&p);
        self.sendq.remove(&p);
    }

    /// Sends every held-back batch now.
    pub(super) fn flush_deferred(&mut self) {
        let at = Instant::now();
        for (p, (buf, _)) in std::mem::take(&mut self.deferred) {
            self.send_batch(p, &buf, at);
        }
    }

    /// Starts a resume (after being fenced by a mover) or a relocation (a peer's region is
    /// full): a new epoch from the controller, recovery under it; ops not acknowledged yet are
    /// resubmitted by [`Shim::finish_resume`] once it is ready.
    pub(super) fn start_resume(&mut self, fd: c_int, failure: &Failure) -> Result<(), String> {
        let t = self.files.get_mut(&fd).ok_or("file vanished")?;
        t.resumes += 1;
        if t.resumes > MAX_RESUMES_PER_WAIT {
            return Err(format!("{failure} (gave up after {MAX_RESUMES_PER_WAIT} resumes)"));
        }
        let (key, owner) = (t.key.clone(), t.owner_epoch);
        if t.resume.is_none() {
            t.resume = Some((t.client.unacked_ops(), t.client.size()));
        }
        let req = match failure {
            Failure::Fenced { .. } => CtlRequest::Resume { key: key.clone(), epoch: owner },
            Failure::RegionFull { peer, .. } => CtlRequest::Relocate { key: key.clone(), epoch: owner, full: *peer },
            f => return Err(f.to_string()),
        };
        let grant = match self.ctl(&req) {
            Ok(CtlReply::Granted(g)) => g,
            Ok(other) => return Err(format!("controller answered {other:?}")),
            Err(e) => {
                if matches!(failure, Failure::RegionFull { .. }) {
                    FAIL_ERRNO.with(|x| x.set(libc::ENOSPC));
                }
                return Err(format!("{failure}; {e}"));
            }
        };
        log(&format!("{key}: {failure}; continuing at epoch {} on peers {:?}", grant.epoch, grant.peers.iter().map(|p| p.id).collect::<Vec<_>>()));
        self.learn(&grant);
        let ids = |v: &[nearlog::proto::PeerAddr]| v.iter().map(|p| p.id).collect::<Vec<_>>();
        let now = self.now_us();
        let t = self.files.get_mut(&fd).unwrap();
        t.owner_epoch = grant.epoch;
        // Our local copy holds every op we submitted: recovery fetches only the chunks whose
        // block checksums differ from it (those our unacknowledged ops touched, if any).
        let size = t.resume.as_ref().map_or(0, |r| r.1);
        let local = read_local(t.read_fd, size).map_err(|e| format!("reading the local copy: {e}"))?;
        t.client = FileClient::open_moving(grant.file, grant.epoch, ids(&grant.peers), ids(&grant.recover_from), true, Vec::new(), ClientConfig::default(), now)
            .with_local_copy(local);
        Ok(())
    }

    /// The resumed epoch is ready: checks that the recovered content plus our unacknowledged
    /// ops is exactly our local copy (nobody else wrote), ends a pending move, resubmits.
    pub(super) fn finish_resume(&mut self, fd: c_int) -> Result<(), String> {
        let t = self.files.get_mut(&fd).ok_or("file vanished")?;
        let (ops, size) = t.resume.take().unwrap();
        let mut img = t.client.take_recovered().unwrap_or_default();
        for op in &ops {
            nearlog::proto::apply_op(&mut img, op);
        }
        let local = read_local(t.read_fd, size).map_err(|e| format!("reading the local copy: {e}"))?;
        if img != local {
            return Err(format!("{} changed on the log peers while this writer was fenced (another writer?)", t.key));
        }
        let (key, epoch) = (t.key.clone(), t.client.epoch());
        let (fetched, reused) = t.client.recovery_bytes();
        log(&format!("{key}: resumed at epoch {epoch}: {fetched} bytes fetched from the log peers, {reused} verified from the local copy"));
        if let Err(e) = self.ctl(&CtlRequest::Initialized { key, epoch }) {
            log(&format!("after resuming: {e}"));
        }
        let t = self.files.get_mut(&fd).unwrap();
        for op in ops {
            t.client.submit(op).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    pub(super) fn learn(&mut self, g: &FileGrant) {
        for p in g.peers.iter().chain(&g.recover_from) {
            let e = self.peers.entry(p.id).or_insert_with(|| (p.addr.clone(), None, Instant::now() - Duration::from_secs(1)));
            if e.0 != p.addr {
                // The peer restarted at another address (it kept its id): reconnect there.
                *e = (p.addr.clone(), None, Instant::now() - Duration::from_secs(1));
            }
        }
    }

    /// Pumps until `done` holds for the file on `fd`, it failed, or the deadline passed. With
    /// `may_resume`, being fenced by a mover or meeting a full region continues at a new epoch.
    pub(super) fn wait_for(&mut self, fd: c_int, may_resume: bool, done: impl Fn(&FileClient) -> bool) -> Result<(), String> {
        let deadline = Instant::now() + self.cfg.deadline;
        self.files.get_mut(&fd).ok_or("file vanished")?.resumes = 0;
        loop {
            let t = self.files.get_mut(&fd).ok_or("file vanished")?;
            if let Some(f) = t.client.failure().cloned() {
                if may_resume && matches!(f, Failure::Fenced { .. } | Failure::RegionFull { .. }) {
                    self.start_resume(fd, &f)?;
                    continue;
                }
                self.flush_deferred();
                return Err(f.to_string());
            }
            if t.resume.is_some() {
                if t.client.is_ready() {
                    self.finish_resume(fd)?;
                    continue;
                }
            } else if done(&t.client) {
                return Ok(());
            }
            if t.client.wants_local_copy() {
                // A known copy that is no longer current: only the chunks that differ are fetched.
                let fd_r = if t.read_fd >= 0 { t.read_fd } else { fd };
                // SAFETY: fstat into a zeroed struct.
                let mut st: libc::stat64 = unsafe { std::mem::zeroed() };
                let local = if unsafe { libc::fstat64(fd_r, &mut st) } == 0 { read_local(fd_r, st.st_size as u64).unwrap_or_default() } else { Vec::new() };
                t.client.handle(Input::LocalCopy(local));
                continue;
            }
            if t.client.wants_image() {
                // Basing on a known local copy, and a peer lacks that state: it needs the bytes.
                let size = t.client.size();
                match read_local(t.read_fd, size) {
                    Ok(img) if img.len() as u64 == size => t.client.handle(Input::Image(img)),
                    Ok(img) => return Err(format!("the local copy is {} bytes, not the {size} it was known to hold", img.len())),
                    Err(e) => return Err(format!("cannot read the local copy for a peer that lacks it: {e}")),
                }
                continue;
            }
            if let Some(peer) = t.client.wants_resync() {
                // A peer lost this file (restarted): re-base it from our local copy.
                log(&format!("log peer {peer} lost file {} (epoch {}): resyncing it from the local copy", t.key, t.client.epoch()));
                let size = t.client.size();
                match read_local(t.read_fd, size) {
                    Ok(img) => t.client.handle(Input::Resync { peer, image: img }),
                    Err(e) => return Err(format!("cannot read the local copy to resync peer {peer}: {e}")),
                }
            }
            if Instant::now() >= deadline {
                self.flush_deferred();
                return Err(format!("no majority of log peers within {} ms", self.cfg.deadline.as_millis()));
            }
            self.pump(Duration::from_millis(5));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dial_is_patient_only_for_a_peer_that_failed_while_no_majority_is_connected() {
        use PEER_CONNECT_TIMEOUT as LONG;
        use PEER_CONNECT_TIMEOUT_OPTIMISTIC as SHORT;
        // Three peers, two connected: the third (dead or not) costs at most the short timeout.
        assert_eq!(peer_connect_timeout(2, 3, true), SHORT);
        // A first dial is optimistic, connected or not (a fresh process connects nothing yet).
        assert_eq!(peer_connect_timeout(0, 3, false), SHORT);
        // A peer whose dial failed, without a majority: the write needs this dial.
        assert_eq!(peer_connect_timeout(1, 3, true), LONG);
        assert_eq!(peer_connect_timeout(0, 3, true), LONG);
        assert_eq!(peer_connect_timeout(2, 4, true), LONG);
        assert!(SHORT < LONG);
    }
}
