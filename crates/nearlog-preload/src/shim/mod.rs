//! The shim's state and the real work behind each intercepted call.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, CStr};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libc::{c_int, c_void, iovec, mode_t, off_t, size_t, ssize_t};
use nearlog::driver::blocking;
use nearlog::core::file_client::{ClientConfig, Failure, FileClient, Input};
use nearlog::proto::{CtlReply, CtlRequest, FileGrant, Op, PeerId, PeerReply, PeerRequest, MAX_CHUNK_BYTES, MAX_FRAME_BYTES};

use crate::forklock::ForkLock;
use crate::O_NCL;

type OpenAtFn = unsafe extern "C" fn(c_int, *const c_char, c_int, mode_t) -> c_int;
type WriteFn = unsafe extern "C" fn(c_int, *const c_void, size_t) -> ssize_t;
type PwriteFn = unsafe extern "C" fn(c_int, *const c_void, size_t, off_t) -> ssize_t;
type WritevFn = unsafe extern "C" fn(c_int, *const iovec, c_int) -> ssize_t;
type FdFn = unsafe extern "C" fn(c_int) -> c_int;
type SfrFn = unsafe extern "C" fn(c_int, i64, i64, libc::c_uint) -> c_int;
type TruncFn = unsafe extern "C" fn(c_int, off_t) -> c_int;
type UnlinkAtFn = unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int;
type RenameFn = unsafe extern "C" fn(*const c_char, *const c_char) -> c_int;

pub(crate) struct Real {
    openat: OpenAtFn,
    write: WriteFn,
    pwrite: PwriteFn,
    writev: WritevFn,
    fsync: FdFn,
    fdatasync: FdFn,
    sync_file_range: SfrFn,
    ftruncate: TruncFn,
    close: FdFn,
    unlinkat: UnlinkAtFn,
    rename: RenameFn,
    dup: FdFn,
    dup2: Dup2Fn,
    dup3: Dup3Fn,
    fcntl: FcntlFn,
    fcntl64: FcntlFn,
    /// The stdio and directory functions `lib.rs` wraps (opaque pointers: cast there).
    pub fdopen: usize,
    pub fileno: usize,
    pub fileno_unlocked: usize,
    pub opendir: usize,
}

/// glibc's own functions, resolved once: at load ([`init_at_load`], before `main`, one thread),
/// so no thread can be half-way through resolving them when another forks.
pub(crate) fn real() -> &'static Real {
    static REAL: OnceLock<Real> = OnceLock::new();
    REAL.get_or_init(|| {
        // SAFETY: dlsym(RTLD_NEXT) returns glibc's own definitions of these well-known symbols,
        // whose C signatures are the function types above.
        unsafe {
            let sym = |name: &[u8]| {
                let p = libc::dlsym(libc::RTLD_NEXT, name.as_ptr() as *const c_char);
                assert!(!p.is_null(), "nearlog shim: libc symbol missing");
                p
            };
            Real {
                openat: std::mem::transmute::<*mut c_void, OpenAtFn>(sym(b"openat64\0")),
                write: std::mem::transmute::<*mut c_void, WriteFn>(sym(b"write\0")),
                pwrite: std::mem::transmute::<*mut c_void, PwriteFn>(sym(b"pwrite64\0")),
                writev: std::mem::transmute::<*mut c_void, WritevFn>(sym(b"writev\0")),
                fsync: std::mem::transmute::<*mut c_void, FdFn>(sym(b"fsync\0")),
                fdatasync: std::mem::transmute::<*mut c_void, FdFn>(sym(b"fdatasync\0")),
                sync_file_range: std::mem::transmute::<*mut c_void, SfrFn>(sym(b"sync_file_range\0")),
                ftruncate: std::mem::transmute::<*mut c_void, TruncFn>(sym(b"ftruncate64\0")),
                close: std::mem::transmute::<*mut c_void, FdFn>(sym(b"close\0")),
                unlinkat: std::mem::transmute::<*mut c_void, UnlinkAtFn>(sym(b"unlinkat\0")),
                rename: std::mem::transmute::<*mut c_void, RenameFn>(sym(b"rename\0")),
                dup: std::mem::transmute::<*mut c_void, FdFn>(sym(b"dup\0")),
                dup2: std::mem::transmute::<*mut c_void, Dup2Fn>(sym(b"dup2\0")),
                dup3: std::mem::transmute::<*mut c_void, Dup3Fn>(sym(b"dup3\0")),
                fcntl: std::mem::transmute::<*mut c_void, FcntlFn>(sym(b"fcntl\0")),
                fcntl64: std::mem::transmute::<*mut c_void, FcntlFn>(sym(b"fcntl64\0")),
                fdopen: sym(b"fdopen\0") as usize,
                fileno: sym(b"fileno\0") as usize,
                fileno_unlocked: sym(b"fileno_unlocked\0") as usize,
                opendir: sym(b"opendir\0") as usize,
            }
        }
    })
}

thread_local! {
    /// Set while the shim itself does I/O: every intercepted call passes straight through.
    static IN_SHIM: Cell<bool> = const { Cell::new(false) };
}

pub(crate) struct Guard;

/// Enters the shim's reentrancy guard (None: this thread is already inside the shim). Every
/// shim lock is taken inside it, so a signal handler, or a fork from one, on a thread that
/// holds a shim lock never waits for that lock.
pub(crate) fn enter() -> Option<Guard> {
    Guard::enter()
}

impl Guard {
    /// None if we are already inside the shim (reentrant call: pass through).
    fn enter() -> Option<Guard> {
        IN_SHIM.with(|g| if g.replace(true) { None } else { Some(Guard) })
    }
}
impl Drop for Guard {
    fn drop(&mut self) {
        IN_SHIM.with(|g| g.set(false));
    }
}

/// A set of fds as a bitmap of atomics: read and changed without a lock (async-signal-safe).
struct FdSet([AtomicU64; MAX_TRACKED_FD / 64]);

impl FdSet {
    const fn new() -> FdSet {
        FdSet([const { AtomicU64::new(0) }; MAX_TRACKED_FD / 64])
    }
    fn has(&self, fd: c_int) -> bool {
        fd >= 0 && (fd as usize) < MAX_TRACKED_FD && self.0[fd as usize / 64].load(Ordering::Relaxed) & (1 << (fd % 64)) != 0
    }
    fn set(&self, fd: c_int, on: bool) {
        if fd < 0 || fd as usize >= MAX_TRACKED_FD {
            return;
        }
        let bit = 1u64 << (fd % 64);
        if on {
            self.0[fd as usize / 64].fetch_or(bit, Ordering::Relaxed);
        } else {
            self.0[fd as usize / 64].fetch_and(!bit, Ordering::Relaxed);
        }
    }
}

/// Fds beyond the bitmaps are never tracked: a log open that gets one fails with EIO rather
/// than going unreplicated.
const MAX_TRACKED_FD: usize = 65536;
/// Fds that are log files (the fast path for every other fd takes no lock).
static TRACKED: FdSet = FdSet::new();
/// In a fork child: the log fds it inherited (a subset of [`TRACKED`], set by
/// [`after_fork_child`]). They are the parent's to replicate, not the child's: a write, sync or
/// truncate on one fails with EIO, a close only clears its bits; no lock either way.
static INHERITED: FdSet = FdSet::new();
/// Log fds closed (or replaced by dup2) from a signal handler that interrupted its own thread
/// inside the shim, which holds the state's lock: the next holder of the lock forgets them
/// ([`lock_state`]). [`ANY_PENDING`] saves every other holder the scan.
static PENDING_FORGET: FdSet = FdSet::new();
static ANY_PENDING: AtomicBool = AtomicBool::new(false);
/// The replication state's own long-lived fds: peer connections and the read fds of log files
/// (set once open, cleared before closing, so a set bit always names one of them). A fork child
/// closes its copies ([`after_fork_child`]): the parent's connections are not the child's to
/// keep open (a peer would not see the parent go while a child lives), and a read fd's lock on
/// [`WRITER_LOCK_BYTE`] says "a writer on this machine keeps this local copy current", which
/// must end with that writer, not with its longest-lived child.
static OWN_FDS: FdSet = FdSet::new();

/// Closes one of the state's own fds ([`OWN_FDS`]).
unsafe fn close_own(fd: c_int) {
    OWN_FDS.set(fd, false);
    (real().close)(fd);
}

fn is_tracked(fd: c_int) -> bool {
    TRACKED.has(fd)
}
fn set_tracked(fd: c_int, on: bool) {
    TRACKED.set(fd, on)
}

/// The controller may know log files by names no pattern matches: set once this process opens
/// a file with [`O_NCL`] or renames a log file to a name outside the patterns. Until then a
/// rename or unlink of a path the patterns do not name is none of the shim's business: it
/// passes through without a lock or a controller round trip.
static UNPATTERNED_KEYS: AtomicBool = AtomicBool::new(false);

/// This process's id, kept without a system call: set at load ([`init_at_load`]) and by the
/// fork child handler. A `vfork` child (no fork handlers run; it shares its parent's memory)
/// still finds its parent's id here: that is how [`in_vfork_child`] tells.
static PID: AtomicU32 = AtomicU32::new(0);

fn pid() -> u32 {
    match PID.load(Ordering::Relaxed) {
        0 => std::process::id(), // not loaded through `init_at_load` (the rlib in unit tests)
        p => p,
    }
}

/// True in a `vfork` (or other `CLONE_VM`) child before it execs: it shares the parent's
/// memory (bitmaps, state, locks) but has its own fd table, so a close or dup there must not
/// touch the parent's bookkeeping. One `getpid` system call (about 0.2 µs here), only on the
/// paths of log fds and log paths, never on the fast path of other fds.
fn in_vfork_child() -> bool {
    let p = PID.load(Ordering::Relaxed);
    // SAFETY: no arguments (glibc does not cache the pid: this is the kernel's answer).
    p != 0 && unsafe { libc::getpid() } as u32 != p
}

/// A child made without fork's handlers (vfork, `clone`, a raw fork system call) never uses
/// the state it finds in memory — its parent's, shared (vfork) or a copy whose sockets the
/// parent goes on using, whose lock may be held for good. A log operation there fails (EIO),
/// said once on stderr. Costs one `getpid` per log operation (a replicated write costs tens of
/// µs).
fn foreign_child(what: &str) -> bool {
    if !in_vfork_child() {
        return false;
    }
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        log(&format!("{what}: EIO: in a child made without fork's handlers (vfork, clone): the shim's state is its parent's (such a child may only exec or _exit)"));
    }
    true
}

/// Runs at load (`.init_array`: before `main`, before the application has threads): the pid,
/// glibc's functions, the patterns, and the fork handlers. Whatever is initialised lazily
/// later ([`known_dir`], [`known_bounds`], [`stats::enabled`]) the prepare handler finishes
/// before a fork, so a child never waits on an initialisation begun by a thread it lacks.
extern "C" fn init_at_load() {
    PID.store(std::process::id(), Ordering::Relaxed);
    let _ = real();
    let _ = patterns();
    // SAFETY: registers three handlers that only use atomics, ForkLocks and system calls.
    unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork_parent), Some(after_fork_child)) };
}

#[used]
#[link_section = ".init_array"]
static INIT_AT_LOAD: extern "C" fn() = init_at_load;

thread_local! {
    /// Set by [`before_fork`] on the forking thread when it took the short locks (the parent
    /// and child handlers run on that thread and release them).
    static HELD_FOR_FORK: Cell<bool> = const { Cell::new(false) };
}

/// The fork prepare handler. The short locks (stdio's stream table, the known copies, the
/// listed directories; held for microseconds to a few tmpfs operations, never across network
/// I/O) are taken in this fixed order, so the child inherits them consistent and free. The
/// state's lock [`SHIM`] is not: it is held across replication round trips (up to
/// `UNDERSTUDY_NEARLOG_DEADLINE_MS`), and a fork must not wait for those; the child replaces
/// that state instead. A fork from a signal handler that interrupted this thread inside the
/// shim takes nothing (this thread may hold any of them): the child then resets every one.
extern "C" fn before_fork() {
    if IN_SHIM.with(|g| g.get()) {
        return;
    }
    let _ = known_dir();
    let _ = known_bounds();
    let _ = stats::enabled();
    crate::stdio::lock_for_fork();
    KNOWN_COPIES.lock_raw();
    LISTED.lock_raw();
    HELD_FOR_FORK.with(|h| h.set(true));
}

extern "C" fn after_fork_parent() {
    if HELD_FOR_FORK.with(|h| h.replace(false)) {
        // SAFETY: taken by `before_fork` on this thread.
        unsafe {
            LISTED.unlock_raw();
            KNOWN_COPIES.unlock_raw();
            crate::stdio::unlock_after_fork();
        }
    }
}

/// The fork child handler (one thread; async-signal-safe: atomics and stores, no allocation —
/// it may run before the allocator's own child handler, jemalloc's in Redis). The child starts
/// with no replication state: a log file it opens gets its own epoch and its own connections,
/// made lazily on first use; the log fds it inherited fail writes with EIO ([`INHERITED`]).
/// The parent's state is left unread (another thread may have been changing it) and its memory
/// stays in the child's copy of the heap; the child's copies of that state's fds (peer
/// connections, read fds) are closed ([`OWN_FDS`]); the parent goes on using its own.
extern "C" fn after_fork_child() {
    // SAFETY: no arguments.
    PID.store(unsafe { libc::getpid() } as u32, Ordering::Relaxed);
    // SAFETY: the child side of fork: this is the only thread.
    unsafe { SHIM.reset_in_child(None) };
    for w in 0..MAX_TRACKED_FD / 64 {
        let t = TRACKED.0[w].load(Ordering::Relaxed);
        if t != 0 {
            INHERITED.0[w].fetch_or(t, Ordering::Relaxed);
        }
        PENDING_FORGET.0[w].store(0, Ordering::Relaxed);
        let mut own = OWN_FDS.0[w].swap(0, Ordering::Relaxed);
        while own != 0 {
            let fd = w * 64 + own.trailing_zeros() as usize;
            own &= own - 1;
            // SAFETY: the system call itself (no interposed close): the child's copy of one of
            // the parent state's fds.
            unsafe { libc::syscall(libc::SYS_close, fd) };
        }
    }
    ANY_PENDING.store(false, Ordering::Relaxed);
    if HELD_FOR_FORK.with(|h| h.replace(false)) {
        // SAFETY: taken by `before_fork` on the thread that forked, which this one is.
        unsafe {
            LISTED.unlock_raw();
            KNOWN_COPIES.unlock_raw();
            crate::stdio::unlock_after_fork();
        }
    } else {
        // SAFETY: as above. The tables may be half-changed: they start empty (they only save
        // re-checks; a stream made before the fork still writes through its own functions).
        unsafe {
            LISTED.reset_in_child(Vec::new());
            KNOWN_COPIES.reset_in_child(Vec::new());
            crate::stdio::reset_in_child();
        }
    }
}

/// A call on a log fd from a signal handler that interrupted this same thread inside the shim:
/// the interrupted frame holds the state's lock, so waiting for it would never end, and passing
/// the call through would leave bytes in the log file that no peer holds. It fails with EIO.
/// The line is a constant, written once per process (a handler may run thousands of times a
/// second): nothing is allocated in a signal handler.
fn reentrant_log_call() {
    static SAID: AtomicBool = AtomicBool::new(false);
    const MSG: &[u8] = b"[nearlog] a log fd used from a signal handler that interrupted the shim on the same thread: EIO (said once per process)\n";
    if !SAID.swap(true, Ordering::Relaxed) {
        // SAFETY: a constant buffer to stderr with the real write.
        unsafe { (real().write)(2, MSG.as_ptr() as *const c_void, MSG.len()) };
    }
    set_errno(libc::EIO);
}

/// Sets close-on-exec on a log fd: a log fd belongs to the process that opened it (see the
/// crate doc); an exec'd program would write to it with no shim state behind it.
fn set_cloexec(fd: c_int) {
    // SAFETY: fcntl on an fd with integer arguments (the raw call: no interposed fcntl).
    unsafe { libc::syscall(libc::SYS_fcntl, fd, libc::F_SETFD, libc::FD_CLOEXEC) };
}

fn log(msg: &str) {
    let line = format!("[nearlog {}] {msg}\n", std::process::id());
    // SAFETY: writing a valid buffer to stderr with the real write.
    unsafe {
        (real().write)(2, line.as_ptr() as *const c_void, line.len());
    }
}

fn set_errno(e: c_int) {
    // SAFETY: errno is thread-local and always valid to write.
    unsafe { *libc::__errno_location() = e };
}

struct Config {
    controller: String,
    secret: Vec<u8>,
    deadline: Duration,
    /// How long a call polls for replies without sleeping (see [`Shim::wait_replies`]).
    spin: Duration,
    /// Longest a batch is held back from the peers beyond a majority ([`Shim::pump`]):
    /// `UNDERSTUDY_NEARLOG_DEFER_US`, default [`DEFAULT_DEFER_US`].
    defer: Duration,
}

/// Default of `UNDERSTUDY_NEARLOG_SPIN_US`: a majority's replies on loopback or a LAN take
/// tens of µs; longer waits (a slow or dead peer) block in `poll` after this.
const DEFAULT_SPIN_US: u64 = 50;

fn load_config() -> Result<Config, String> {
    let deadline_ms = match std::env::var("UNDERSTUDY_NEARLOG_DEADLINE_MS") {
        Ok(s) => s.parse::<u64>().map_err(|_| format!("UNDERSTUDY_NEARLOG_DEADLINE_MS={s:?} is not a number of milliseconds"))?,
        Err(_) => 10_000,
    };
    let cluster = std::env::var("UNDERSTUDY_NEARLOG_CLUSTER").map_err(|_| "UNDERSTUDY_NEARLOG_CLUSTER is not set (the nearlog-cluster.json of `understudy nearlog up`)".to_string())?;
    let text = std::fs::read(&cluster).map_err(|e| format!("cannot read {cluster}: {e}"))?;
    let v: serde_json::Value = serde_json::from_slice(&text).map_err(|e| format!("{cluster} is not JSON: {e}"))?;
    let controller = v["controller"].as_str().ok_or(format!("{cluster} has no \"controller\""))?.to_string();
    let secret_file = v["secret_file"].as_str().ok_or(format!("{cluster} has no \"secret_file\""))?;
    let secret = std::fs::read(secret_file).map_err(|e| format!("cannot read the cluster secret {secret_file}: {e}"))?.trim_ascii().to_vec();
    if secret.is_empty() {
        return Err(format!("cluster secret {secret_file} is empty"));
    }
    let spin_us = match std::env::var("UNDERSTUDY_NEARLOG_SPIN_US") {
        Ok(s) => s.parse::<u64>().ok().filter(|&us| us <= 10_000).ok_or_else(|| format!("UNDERSTUDY_NEARLOG_SPIN_US={s:?} is not a number of microseconds up to 10000"))?,
        Err(_) => DEFAULT_SPIN_US,
    };
    let defer_us = match std::env::var("UNDERSTUDY_NEARLOG_DEFER_US") {
        Ok(s) => s.parse::<u64>().ok().filter(|&us| us <= MAX_DEFER_US).ok_or_else(|| format!("UNDERSTUDY_NEARLOG_DEFER_US={s:?} is not a number of microseconds up to {MAX_DEFER_US}"))?,
        Err(_) => DEFAULT_DEFER_US,
    };
    Ok(Config { controller, secret, deadline: Duration::from_millis(deadline_ms), spin: Duration::from_micros(spin_us), defer: Duration::from_micros(defer_us) })
}

/// `*` matches any run of characters (including `/`), `?` one character.
pub fn glob_match(pat: &str, s: &str) -> bool {
    let (p, s) = (pat.as_bytes(), s.as_bytes());
    let (mut pi, mut si, mut star, mut mark) = (0, 0, None, 0);
    while si < s.len() {
        if pi < p.len() && (p[pi] == b'?' || p[pi] == s[si]) {
            pi += 1;
            si += 1;
        } else if pi < p.len() && p[pi] == b'*' {
            star = Some(pi);
            pi += 1;
            mark = si;
        } else if let Some(sp) = star {
            pi = sp + 1;
            mark += 1;
            si = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

struct Tracked {
    key: String,
    client: FileClient,
    /// A read-only fd on the same file (the application's may be write-only), for resyncs.
    read_fd: c_int,
    /// The epoch this writer owns the file at (its open, or its last resume/relocation); a
    /// mover's newer epoch does not take ownership, so after being fenced by one we resume.
    owner_epoch: u64,
    /// A resume in progress: ops not acknowledged in the old epoch (resubmitted once the new
    /// epoch is ready) and the replicated size after them.
    resume: Option<(Vec<Op>, u64)>,
    /// Resumes and relocations so far in this wait (bounded: no endless ping-pong).
    resumes: u32,
}

/// Default of `UNDERSTUDY_NEARLOG_DEFER_US` ([`Config::defer`]).
const DEFAULT_DEFER_US: u64 = 1_000;
/// Largest `UNDERSTUDY_NEARLOG_DEFER_US`: how far the peers beyond the majority may lag.
const MAX_DEFER_US: u64 = 100_000;
/// Most bytes queued for one peer connection that its socket has not taken yet (an image
/// staged to a lagging peer is up to a file's size); past it the connection is dropped.
const MAX_QUEUED_SEND_BYTES: usize = 512 << 20;
/// A send queue keeps at most this much capacity once drained (and drops its sent front past it).
const SENDQ_KEEP_BYTES: usize = 1 << 20;

/// Counters of the write path, printed to stderr every [`STATS_EVERY_WRITES`] replicated writes
/// when `UNDERSTUDY_NEARLOG_STATS=1` (where a write's time goes: system calls, polls, waits).
mod stats {
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
const STATS_EVERY_WRITES: u64 = 2_000;

/// Resumes or relocations one wait may go through before it gives up with EIO.
const MAX_RESUMES_PER_WAIT: u32 = 8;

thread_local! {
    /// errno of the last failed log operation on this thread (EIO unless a region was full
    /// everywhere: ENOSPC).
    static FAIL_ERRNO: Cell<c_int> = const { Cell::new(libc::EIO) };
}

fn take_fail_errno() -> c_int {
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
fn reopen_readonly(fd: c_int) -> Result<c_int, String> {
    let p = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).unwrap();
    // SAFETY: real openat on a valid C string.
    let r = unsafe { (real().openat)(libc::AT_FDCWD, p.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC, 0) };
    if r < 0 {
        return Err(format!("cannot reopen fd {fd} for reading: {}", std::io::Error::last_os_error()));
    }
    OWN_FDS.set(r, true);
    Ok(r)
}

struct Shim {
    cfg: Config,
    peers: HashMap<PeerId, (String, Option<TcpStream>, Instant)>,
    files: HashMap<c_int, Tracked>,
    /// dup/dup2/dup3/F_DUPFD copies of log fds -> the fd their `Tracked` is filed under (they
    /// share the open file description, so one replication state serves them all).
    aliases: HashMap<c_int, c_int>,
    /// Reply buffers of the peer connections (reset with each new connection).
    readers: HashMap<PeerId, blocking::FrameReader>,
    /// Bytes held back for the peers beyond a majority (see [`Shim::pump`]), and since when.
    deferred: HashMap<PeerId, (Vec<u8>, Instant)>,
    /// Per peer: when the oldest unanswered batch went out, and a moving average of the time
    /// to its first reply (µs): the quickest majority is sent to first.
    reply_us: HashMap<PeerId, (Option<Instant>, u64)>,
    /// Per peer: bytes handed to its connection that the kernel has not taken yet, and how many
    /// of them went out. Sends never block the application: a large transfer to one peer (the
    /// image staged to a peer that lags after a crash, a resync) goes out as its socket drains,
    /// during later pumps, while the majority's small records pass on their own connections.
    sendq: HashMap<PeerId, (Vec<u8>, usize)>,
    start: Instant,
}

/// The replication state: one lock, held across replication round trips. A fork's child
/// replaces it ([`after_fork_child`]). Take it with [`lock_state`].
static SHIM: ForkLock<Option<Shim>> = ForkLock::new(None);

/// Locks the state, first forgetting the log fds a signal handler closed meanwhile
/// ([`PENDING_FORGET`]).
fn lock_state() -> crate::forklock::ForkGuard<'static, Option<Shim>> {
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
/// Config errors are reported once per process, then every log open fails.
static PATTERNS: OnceLock<Vec<String>> = OnceLock::new();

fn patterns() -> &'static [String] {
    PATTERNS.get_or_init(|| std::env::var("UNDERSTUDY_NEARLOG_PATTERNS").unwrap_or_default().split(':').filter(|p| !p.is_empty()).map(String::from).collect())
}

/// The absolute path of `path` relative to `dirfd` (lexically; the file may not exist yet).
unsafe fn absolute(dirfd: c_int, path: &CStr) -> Option<String> {
    let p = path.to_str().ok()?;
    if p.starts_with('/') {
        return Some(normalize(p));
    }
    let base = if dirfd == libc::AT_FDCWD {
        std::env::current_dir().ok()?.to_str()?.to_string()
    } else {
        std::fs::read_link(format!("/proc/self/fd/{dirfd}")).ok()?.to_str()?.to_string()
    };
    Some(normalize(&format!("{base}/{p}")))
}

fn normalize(p: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    format!("/{}", out.join("/"))
}

/// Whether `path` (relative to the working directory) names a log file by the patterns.
pub unsafe fn is_log_stream_path(path: *const c_char) -> bool {
    if path.is_null() || patterns().is_empty() {
        return false;
    }
    let Some(_g) = Guard::enter() else { return false };
    absolute(libc::AT_FDCWD, CStr::from_ptr(path)).is_some_and(|abs| is_log_path(&abs))
}

/// Whether `fd` is a replicated log fd.
pub fn is_log_fd(fd: c_int) -> bool {
    is_tracked(fd) && IN_SHIM.with(|g| !g.get())
}

fn is_log_path(abs: &str) -> bool {
    patterns().iter().any(|p| glob_match(p, abs))
}

impl Shim {
    fn get(slot: &mut Option<Shim>) -> Result<&mut Shim, String> {
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
                start: Instant::now(),
            });
        }
        Ok(slot.as_mut().unwrap())
    }

    fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    fn ctl(&mut self, req: &CtlRequest) -> Result<CtlReply, String> {
        let mut s = blocking::connect(&self.cfg.controller, &self.cfg.secret, Duration::from_secs(5)).map_err(|e| format!("controller {}: {e}", self.cfg.controller))?;
        let rep: CtlReply = blocking::call(&mut s, req, MAX_FRAME_BYTES).map_err(|e| format!("controller {}: {e}", self.cfg.controller))?;
        if let CtlReply::Error(e) = &rep {
            return Err(format!("controller refused {req:?}: {e}"));
        }
        Ok(rep)
    }

    fn ensure_conn(&mut self, peer: PeerId) -> Option<&mut TcpStream> {
        let secret = &self.cfg.secret;
        let (addr, conn, last_try) = self.peers.get_mut(&peer)?;
        if conn.is_none() && last_try.elapsed() >= Duration::from_millis(200) {
            *last_try = Instant::now();
            match blocking::connect(addr, secret, Duration::from_secs(2)) {
                Ok(s) => {
                    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                    OWN_FDS.set(s.as_raw_fd(), true);
                    *conn = Some(s);
                    self.readers.remove(&peer);
                    self.sendq.remove(&peer);
                }
                Err(e) => log(&format!("log peer {peer} at {addr} unreachable: {e}")),
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
    fn pump(&mut self, wait: Duration) {
        stats::add(&stats::PUMPS, 1);
        let now = self.now_us();
        let mut out: Vec<(PeerId, PeerRequest)> = Vec::new();
        for t in self.files.values_mut() {
            t.client.handle(Input::Tick { now_us: now });
            out.extend(t.client.take_outputs());
        }
        // One buffer per peer: a batch goes out in one write. A record goes to every peer
        // alike (consecutive equal requests): it is encoded and checksummed once.
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
        let fresh: Vec<PeerId> = batches.keys().copied().collect();
        let connected = |s: &Shim, p: &PeerId| s.peers.get(p).is_some_and(|v| v.1.is_some());
        let mut hold: Vec<PeerId> = Vec::new();
        if fresh.len() >= 3 && fresh.iter().all(|p| connected(self, p)) {
            let mut by_speed = fresh.clone();
            by_speed.sort_by_key(|p| (self.reply_us.get(p).map_or(0, |r| r.1), *p));
            hold = by_speed.split_off(fresh.len() / 2 + 1);
        }
        let at = Instant::now();
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
            // One read takes every reply the kernel has; they are parsed from the buffer.
            let conn = self.peers.get_mut(p).unwrap().1.as_mut().unwrap();
            let reader = self.readers.entry(*p).or_default();
            let mut replies = Vec::new();
            stats::add(&stats::READS, 1);
            let mut lost = match reader.fill(conn) {
                Ok(0) => Some("connection closed".to_string()),
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
            if !replies.is_empty() {
                if let Some(r) = self.reply_us.get_mut(p) {
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
                        t.client.handle(Input::Reply { peer: *p, reply: rep.clone() });
                    }
                }
            }
            if let Some(e) = lost {
                log(&format!("log peer {p}: connection lost: {e}"));
                self.drop_conn(*p);
            }
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
    fn wait_replies(&self, fds: &mut [libc::pollfd], wait: Duration) -> bool {
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

    fn send_batch(&mut self, p: PeerId, buf: &[u8], at: Instant) {
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
    fn try_send(&mut self, p: PeerId) {
        let Some(fd) = self.peers.get(&p).and_then(|v| v.1.as_ref()).map(|c| c.as_raw_fd()) else { return };
        let Some(q) = self.sendq.get_mut(&p) else { return };
        let mut failed = None;
        while q.1 < q.0.len() {
            let rest = &q.0[q.1..];
            // SAFETY: sending from our own buffer within its bounds; the fd is our connection.
            let n = unsafe { libc::send(fd, rest.as_ptr() as *const c_void, rest.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
            stats::add(&stats::SENDS, 1);
            if n >= 0 {
                q.1 += n as usize;
                continue;
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) => break,
                _ => {
                    failed = Some(e);
                    break;
                }
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

    fn has_queued(&self, p: &PeerId) -> bool {
        self.sendq.get(p).is_some_and(|q| q.1 < q.0.len())
    }

    fn drop_conn(&mut self, p: PeerId) {
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
    fn flush_deferred(&mut self) {
        let at = Instant::now();
        for (p, (buf, _)) in std::mem::take(&mut self.deferred) {
            self.send_batch(p, &buf, at);
        }
    }

    /// Starts a resume (after being fenced by a mover) or a relocation (a peer's region is
    /// full): a new epoch from the controller, recovery under it; ops not acknowledged yet are
    /// resubmitted by [`Shim::finish_resume`] once it is ready.
    fn start_resume(&mut self, fd: c_int, failure: &Failure) -> Result<(), String> {
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
    fn finish_resume(&mut self, fd: c_int) -> Result<(), String> {
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

    fn learn(&mut self, g: &FileGrant) {
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
    fn wait_for(&mut self, fd: c_int, may_resume: bool, done: impl Fn(&FileClient) -> bool) -> Result<(), String> {
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


fn read_local(fd: c_int, size: u64) -> std::io::Result<Vec<u8>> {
    read_local_at(fd, 0, size as usize)
}

/// `len` bytes of the local file from `offset` (zeros past its end).
fn read_local_at(fd: c_int, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
    let mut img = vec![0u8; len];
    let mut done = 0;
    while done < img.len() {
        // SAFETY: reading into our own buffer within its bounds.
        let n = unsafe { libc::pread64(fd, img[done..].as_mut_ptr() as *mut c_void, img.len() - done, (offset + done as u64) as i64) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue; // a signal to the application: not a failed read
            }
            return Err(e);
        }
        if n == 0 {
            break; // shorter than replicated: the rest reads as zeros
        }
        done += n as usize;
    }
    Ok(img)
}

fn write_local_all(fd: c_int, data: &[u8], offset: u64) -> std::io::Result<()> {
    // On Linux pwrite on an O_APPEND fd appends whatever the offset (a repair of an
    // application's append-only log fd, Redis's AOF, would land at the end, then be truncated
    // away): the flag is off while the bytes go to their offsets.
    // SAFETY: fcntl on our caller's fd with integer arguments.
    let flags = unsafe { libc::syscall(libc::SYS_fcntl, fd, libc::F_GETFL) } as c_int;
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if flags & libc::O_APPEND != 0 {
        // SAFETY: as above.
        if unsafe { libc::syscall(libc::SYS_fcntl, fd, libc::F_SETFL, flags & !libc::O_APPEND) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    let r = write_at_all(fd, data, offset);
    if flags & libc::O_APPEND != 0 {
        // SAFETY: as above (restores the application's flags).
        unsafe { libc::syscall(libc::SYS_fcntl, fd, libc::F_SETFL, flags) };
    }
    r
}

fn write_at_all(fd: c_int, data: &[u8], offset: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < data.len() {
        // SAFETY: writing from our own buffer within its bounds with the real pwrite.
        let n = unsafe { (real().pwrite)(fd, data[done..].as_ptr() as *const c_void, data.len() - done, (offset + done as u64) as off_t) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue; // a signal to the application: not a failed write
            }
            return Err(e);
        }
        done += n as usize;
    }
    Ok(())
}

pub unsafe fn open_at(dirfd: c_int, path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    let r = real();
    let Some(_g) = Guard::enter() else { return (r.openat)(dirfd, path, flags & !O_NCL, mode) };
    let opted_in = flags & O_NCL != 0;
    let flags = flags & !O_NCL;
    if opted_in {
        UNPATTERNED_KEYS.store(true, Ordering::Relaxed);
    }
    let writable = flags & (libc::O_WRONLY | libc::O_RDWR) != 0;
    if path.is_null() || (!opted_in && patterns().is_empty()) {
        return (r.openat)(dirfd, path, flags, mode);
    }
    let cpath = CStr::from_ptr(path);
    let Some(abs) = absolute(dirfd, cpath) else { return (r.openat)(dirfd, path, flags, mode) };
    if !opted_in && !is_log_path(&abs) {
        return (r.openat)(dirfd, path, flags, mode);
    }
    if foreign_child(&format!("open {abs}")) {
        set_errno(libc::EIO);
        return -1;
    }
    if !writable {
        // A reader (e.g. the application's own crash recovery) gets a local copy verified
        // against a majority of peers first (recovered if missing, repaired if stale), at the
        // reader's epoch: a reader never fences the writer.
        if sync_local_copy(&abs, false).is_err() {
            set_errno(libc::EIO);
            return -1;
        }
        return (r.openat)(dirfd, path, flags, mode);
    }
    let mut slot = lock_state();
    let shim = match Shim::get(&mut slot) {
        Ok(s) => s,
        Err(e) => {
            log(&format!("open {abs}: EIO: nearlog is misconfigured: {e}"));
            set_errno(libc::EIO);
            return -1;
        }
    };
    // Close-on-exec whatever the application asked (see the crate doc).
    let fd = (r.openat)(dirfd, path, flags | libc::O_CLOEXEC, mode);
    if fd < 0 {
        return fd;
    }
    match open_log(shim, fd, &abs, flags) {
        Ok(()) => fd,
        Err(e) => {
            log(&format!("open {abs}: EIO: {e}"));
            shim.files.remove(&fd);
            set_tracked(fd, false);
            (r.close)(fd);
            set_errno(libc::EIO);
            -1
        }
    }
}

/// The byte of a log file that stands for "a writer through the shim has this file open on
/// this machine": each such writer holds an OFD read lock on it (on its private read fd) for as
/// long as the file is open; a reader about to repair the local copy takes a write lock on it,
/// so it never rewrites a file a live local writer keeps current (whose writes land in the
/// local file before they are acknowledged). Far past any real log's end, so an application's
/// own byte-range locks do not meet it.
const WRITER_LOCK_BYTE: i64 = i64::MAX - 1;

/// Sets (`F_RDLCK`/`F_WRLCK`) or tests (`test`: `F_OFD_GETLK`) the OFD lock on
/// [`WRITER_LOCK_BYTE`]. Ok(false): another open file description holds a conflicting lock.
fn writer_lock(fd: c_int, kind: libc::c_short, test: bool) -> std::io::Result<bool> {
    // SAFETY: a zeroed flock is a valid value; fcntl reads (and for GETLK writes) our struct.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = WRITER_LOCK_BYTE;
    fl.l_len = 1;
    let cmd = if test { libc::F_OFD_GETLK } else { libc::F_OFD_SETLK };
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, cmd, &mut fl as *mut libc::flock) } != 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
            _ => Err(e),
        };
    }
    Ok(!test || fl.l_type == libc::F_UNLCK as libc::c_short)
}

/// Before log file `abs` is read without a writer in this process (a read-only `open`, `fopen`
/// for reading; with `only_if_missing`, `stat` and directory listings): makes the local copy
/// what a majority of peers hold — recovered if missing, repaired if stale (a machine whose
/// file is older than the peers', or whose page cache lost unsynced data in a crash). Read at
/// [`nearlog::proto::READ_EPOCH`] ([`FileClient::reader`]): a live writer elsewhere is not
/// fenced. Cheap when the copy is current: one controller lookup, one probe round, the block
/// checksums of the source, a local read; nothing written. Skipped when a writer keeps the
/// local copy current: one in this process, or one on this machine (its lock on
/// [`WRITER_LOCK_BYTE`]). A stale copy that cannot be repaired (no write permission) or a
/// majority that cannot be reached: an error, logged (the open fails with EIO).
fn sync_local_copy(abs: &str, only_if_missing: bool) -> Result<(), ()> {
    let exists = std::path::Path::new(abs).exists();
    if only_if_missing && exists {
        return Ok(());
    }
    if foreign_child(&format!("reading {abs}")) {
        return Err(());
    }
    let mut slot = lock_state();
    let shim = match Shim::get(&mut slot) {
        Ok(s) => s,
        Err(e) => {
            log(&format!("open {abs}: EIO: nearlog is misconfigured: {e}"));
            return Err(());
        }
    };
    if exists && shim.files.values().any(|t| t.key == abs) {
        return Ok(()); // our own writer's writes land in the local file before they are acked
    }
    let grant = match shim.ctl(&CtlRequest::Lookup { key: abs.to_string() }) {
        Ok(CtlReply::Found(Some(g))) => g,
        // Never replicated: nothing to recover (a missing file's open fails as it should).
        Ok(CtlReply::Found(None)) => return Ok(()),
        Ok(other) => {
            log(&format!("open {abs}: EIO: the controller answered Lookup with {other:?}"));
            return Err(());
        }
        Err(e) => {
            log(&format!("open {abs}: EIO: {e}"));
            return Err(());
        }
    };
    if !grant.initialized {
        return Ok(()); // nothing was ever acknowledged: the local copy is all there is
    }
    let c = std::ffi::CString::new(abs).map_err(|_| ())?;
    // SAFETY: real openat on a path we own; the fd is closed below.
    let open = |flags| unsafe { (real().openat)(libc::AT_FDCWD, c.as_ptr(), flags | libc::O_CLOEXEC, 0o644) };
    let (fd, writable) = match open(libc::O_RDWR | libc::O_CREAT) {
        fd if fd >= 0 => (fd, true),
        _ => (open(libc::O_RDONLY), false), // no write permission: verify only
    };
    if fd < 0 {
        log(&format!("open {abs}: EIO: cannot open the local copy: {}", std::io::Error::last_os_error()));
        return Err(());
    }
    let res = verify_local_copy(shim, fd, writable, &grant);
    shim.files.remove(&fd);
    // SAFETY: closing the fd we opened (which drops our lock).
    unsafe { (real().close)(fd) };
    res.map_err(|e| log(&format!("open {abs}: EIO: {e}")))
}

/// [`sync_local_copy`]'s work on the local file `fd` (open for writing if `writable`).
fn verify_local_copy(shim: &mut Shim, fd: c_int, writable: bool, grant: &FileGrant) -> Result<(), String> {
    let key = grant.key.as_str();
    let lock = if writable { writer_lock(fd, libc::F_WRLCK as libc::c_short, false) } else { writer_lock(fd, libc::F_WRLCK as libc::c_short, true) };
    match lock {
        Ok(true) => {}
        Ok(false) => return Ok(()), // a writer on this machine keeps the local copy current
        Err(e) => return Err(format!("locking the local copy: {e}")),
    }
    // SAFETY: fstat into a zeroed struct.
    let mut st: libc::stat64 = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat64(fd, &mut st) } != 0 {
        return Err(format!("fstat: {}", std::io::Error::last_os_error()));
    }
    let local_size = st.st_size as u64;
    shim.learn(grant);
    let ids = |v: &[nearlog::proto::PeerAddr]| v.iter().map(|p| p.id).collect::<Vec<_>>();
    let client = FileClient::reader(grant.file, ids(&grant.peers), ids(&grant.recover_from), ClientConfig::default(), shim.now_us());
    // A copy this process made current (recovered or verified) and nobody changed since: the
    // peers are only asked whether a majority's most advanced copy is still that state (no
    // local read, no checksums: RocksDB lists its WAL directory, which recovers the WAL, then
    // opens the WAL to read it, at once).
    // (Only where a copy found stale can be rewritten. A state that moved on is compared
    // with the local bytes: only the chunks that differ are fetched.)
    let client = match known_copy(key, grant.file, &st).filter(|_| writable) {
        Some(h) => client.with_known_state(h),
        None => client.with_local_copy(read_local(fd, local_size).map_err(|e| format!("reading the local copy: {e}"))?),
    };
    shim.files.insert(fd, Tracked { key: key.to_string(), client, read_fd: -1, owner_epoch: 0, resume: None, resumes: 0 });
    shim.wait_for(fd, false, |c| c.is_ready()).map_err(|e| format!("verifying the local copy against the log peers: {e}"))?;
    let t = shim.files.get_mut(&fd).unwrap();
    let state = t.client.read_state();
    if t.client.matched_known() {
        return Ok(());
    }
    let image = t.client.take_recovered().unwrap_or_default();
    let (fetched, reused) = t.client.recovery_bytes();
    if fetched == 0 && image.len() as u64 == local_size {
        remember_copy(key, grant.file, fd, state);
        return Ok(()); // every chunk matched the source's checksums: current
    }
    if !writable {
        return Err(format!("the local copy ({local_size} bytes) is stale ({} bytes on the log peers) and cannot be written", image.len()));
    }
    for (i, want) in image.chunks(MAX_CHUNK_BYTES).enumerate() {
        let at = (i * MAX_CHUNK_BYTES) as u64;
        if read_local_at(fd, at, want.len()).map_err(|e| format!("reading the local copy: {e}"))? != want {
            write_local_all(fd, want, at).map_err(|e| format!("repairing the local copy: {e}"))?;
        }
    }
    // SAFETY: real ftruncate on our fd.
    if local_size != image.len() as u64 && unsafe { (real().ftruncate)(fd, image.len() as off_t) } != 0 {
        return Err(format!("repairing the local copy: {}", std::io::Error::last_os_error()));
    }
    log(&format!(
        "recovered {key} for reading: its local copy ({local_size} bytes) was missing or stale; now the {} bytes a majority of log peers hold ({fetched} fetched, {reused} verified locally)",
        image.len()
    ));
    remember_copy(key, grant.file, fd, state);
    Ok(())
}

/// Local copies this process made current for reading: key, file id, the state their content
/// is, and the file's identity and change times right after ([`verify_local_copy`]).
type KnownCopy = (String, nearlog::proto::FileId, nearlog::proto::Holding, [i64; 6]);
static KNOWN_COPIES: ForkLock<Vec<KnownCopy>> = ForkLock::new(Vec::new());
/// Longest [`remember_copy`] waits for the file-time clock to tick past the copy's change time.
const MAX_TICK_WAIT_MS: u32 = 20;
/// Copies [`KNOWN_COPIES`] remembers (oldest forgotten first: it only saves a re-check).
const MAX_KNOWN_COPIES: usize = 64;

/// What must be unchanged for a remembered copy to still be that state: any write to the
/// file (through the shim or not), a truncate or a replacement changes one of these.
fn identity(st: &libc::stat64) -> [i64; 6] {
    [st.st_dev as i64, st.st_ino as i64, st.st_size, st.st_mtime, st.st_mtime_nsec, st.st_ctime_nsec]
}

fn known_copy(key: &str, file: nearlog::proto::FileId, st: &libc::stat64) -> Option<nearlog::proto::Holding> {
    let known = KNOWN_COPIES.lock();
    if let Some(h) = known.iter().find(|(k, f, _, id)| k == key && *f == file && *id == identity(st)).map(|(_, _, h, _)| *h) {
        return Some(h);
    }
    drop(known);
    let (k, f, h, id) = known_on_this_boot(key)?;
    (k == key && f == file && id == identity(st)).then_some(h)
}

/// Where remembered copies outlive the process (`nearlog restore`'s helper, then the
/// application): a directory of this user's on tmpfs, so a record never outlives the page
/// cache it vouches for — after a machine crash unsynced local writes may be gone while the
/// file's size and times survived, and the records are gone with the reboot. None when there
/// is no such directory that is ours alone (then only this process remembers).
fn known_dir() -> Option<&'static str> {
    static DIR: OnceLock<Option<String>> = OnceLock::new();
    DIR.get_or_init(|| {
        // SAFETY: no arguments.
        let uid = unsafe { libc::geteuid() };
        let dir = format!("/dev/shm/understudy-nearlog-{uid}");
        let c = std::ffi::CString::new(dir.clone()).ok()?;
        // SAFETY: a valid path; mkdir fails harmlessly if it exists.
        unsafe { libc::mkdir(c.as_ptr(), 0o700) };
        // SAFETY: lstat into a zeroed struct.
        let mut st: libc::stat64 = unsafe { std::mem::zeroed() };
        let ok = unsafe { libc::lstat64(c.as_ptr(), &mut st) } == 0
            && st.st_mode & libc::S_IFMT == libc::S_IFDIR
            && st.st_uid == uid
            && st.st_mode & 0o077 == 0;
        ok.then_some(dir)
    })
    .as_deref()
}

fn known_path(key: &str) -> Option<String> {
    // FNV-1a of the key names the record; the record holds the key (a collision is a miss).
    let h = key.bytes().fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3));
    Some(format!("{}/{h:016x}", known_dir()?))
}

fn known_on_this_boot(key: &str) -> Option<KnownCopy> {
    let text = std::fs::read_to_string(known_path(key)?).ok()?;
    let (k, rest) = text.split_once('\n')?;
    let n: Vec<u64> = rest.split_whitespace().map(|v| v.parse::<i64>().map(|v| v as u64)).collect::<Result<_, _>>().ok()?;
    let [file, epoch, seq, size, i0, i1, i2, i3, i4, i5] = n[..] else { return None };
    let id = [i0 as i64, i1 as i64, i2 as i64, i3 as i64, i4 as i64, i5 as i64];
    Some((k.to_string(), file, nearlog::proto::Holding { epoch, seq, size }, id))
}

/// Default of `UNDERSTUDY_NEARLOG_KNOWN_MAX_RECORDS`: records kept on tmpfs (each names one log
/// file; the oldest are removed first — a missing record only costs a re-check of its copy).
const DEFAULT_KNOWN_MAX_RECORDS: usize = 1024;
/// Default of `UNDERSTUDY_NEARLOG_KNOWN_MAX_BYTES`: bytes of tmpfs (memory) the records may take.
const DEFAULT_KNOWN_MAX_BYTES: u64 = 1 << 20;

/// The bounds on tmpfs records: (count, bytes), from the environment (read once).
fn known_bounds() -> (usize, u64) {
    static B: OnceLock<(usize, u64)> = OnceLock::new();
    *B.get_or_init(|| {
        let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
        (env("UNDERSTUDY_NEARLOG_KNOWN_MAX_RECORDS").map_or(DEFAULT_KNOWN_MAX_RECORDS, |n| n as usize), env("UNDERSTUDY_NEARLOG_KNOWN_MAX_BYTES").unwrap_or(DEFAULT_KNOWN_MAX_BYTES))
    })
}

/// Removes the oldest records until one of `incoming` bytes fits the bounds beside the rest
/// (keys are many when an application names its logs by number: they must not pile up in
/// memory until a reboot). False if it cannot fit at all.
fn make_room_for_record(dir: &str, keep: &str, incoming: u64, (max_records, max_bytes): (usize, u64)) -> bool {
    if max_records == 0 || incoming > max_bytes {
        return false;
    }
    let Ok(rd) = std::fs::read_dir(dir) else { return true };
    let mut records: Vec<(std::time::SystemTime, u64, std::path::PathBuf)> = rd
        .filter_map(|e| e.ok())
        .filter(|e| e.path().to_str() != Some(keep))
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            m.is_file().then(|| (m.modified().unwrap_or(std::time::UNIX_EPOCH), m.len(), e.path()))
        })
        .collect();
    records.sort();
    let mut bytes: u64 = records.iter().map(|r| r.1).sum();
    let mut count = records.len();
    for (_, len, path) in records {
        if count < max_records && bytes + incoming <= max_bytes {
            break;
        }
        let _ = std::fs::remove_file(path);
        count -= 1;
        bytes -= len;
    }
    true
}

fn remember_on_this_boot(c: &KnownCopy) {
    let Some(path) = known_path(&c.0) else { return };
    let (k, f, h, id) = c;
    let text = format!("{k}\n{f} {} {} {} {} {} {} {} {} {}\n", h.epoch, h.seq, h.size, id[0], id[1], id[2], id[3], id[4], id[5]);
    if !make_room_for_record(known_dir().unwrap_or_default(), &path, text.len() as u64, known_bounds()) {
        let _ = std::fs::remove_file(&path); // an older record of this key is no longer true
        return;
    }
    // Replaced atomically: a reader sees the old record or the new one.
    let tmp = format!("{path}.{}", pid());
    if std::fs::write(&tmp, text).is_ok() && std::fs::rename(&tmp, &path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

fn remember_copy(key: &str, file: nearlog::proto::FileId, fd: c_int, state: Option<nearlog::proto::Holding>) {
    let Some(h) = state else { return };
    // SAFETY: fstat into a zeroed struct.
    let mut st: libc::stat64 = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat64(fd, &mut st) } != 0 || st.st_size as u64 != h.size {
        return;
    }
    // File times come from a coarse clock: a change within the same tick as the last one
    // leaves them as they are. Remembered only once that tick is over (waiting a tick at
    // most, a few ms), so any later change moves the change time.
    let changed = (st.st_ctime as i64, st.st_ctime_nsec as i64);
    let coarse_now = || {
        // SAFETY: clock_gettime into a zeroed struct.
        let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
        unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) };
        (ts.tv_sec as i64, ts.tv_nsec as i64)
    };
    let mut waited = 0;
    while coarse_now() <= changed {
        if waited >= MAX_TICK_WAIT_MS {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
        waited += 1;
    }
    let mut known = KNOWN_COPIES.lock();
    known.retain(|(k, _, _, _)| k != key);
    if known.len() >= MAX_KNOWN_COPIES {
        known.remove(0);
    }
    let c = (key.to_string(), file, h, identity(&st));
    remember_on_this_boot(&c);
    known.push(c);
}

/// A read of log file `path` that does not go through our `open`: `fopen` for reading (glibc
/// opens inside) verifies the local copy like a read-only open; `stat` (`only_if_missing`)
/// recovers a missing one only (an application may stat its log often; the open that
/// follows verifies it).
pub unsafe fn before_read(path: *const c_char, only_if_missing: bool) -> Result<(), ()> {
    if path.is_null() || patterns().is_empty() {
        return Ok(());
    }
    let Some(_g) = Guard::enter() else { return Ok(()) };
    match absolute(libc::AT_FDCWD, CStr::from_ptr(path)) {
        Some(abs) if is_log_path(&abs) => sync_local_copy(&abs, only_if_missing),
        _ => Ok(()),
    }
}

/// `opendir` (an application listing its log directory, as RocksDB does at start): the first
/// time in this process a directory is listed, every replicated log file directly in it that
/// has no local copy is recovered first, so a restart on a new machine or an empty directory
/// sees its log files without `nearlog restore`. A stale local copy is left as it is here (it
/// is made current when the application opens it for writing). Only with patterns set (an
/// opt-in application names its files itself); a controller that cannot be asked is logged
/// and the listing goes ahead (a listing is no log operation; the open that follows fails
/// loudly if the configuration is bad).
pub unsafe fn before_opendir(path: *const c_char) {
    if path.is_null() || patterns().is_empty() {
        return;
    }
    let Some(_g) = Guard::enter() else { return };
    let Some(dir) = absolute(libc::AT_FDCWD, CStr::from_ptr(path)) else { return };
    if in_vfork_child() {
        return; // a listing is no log operation: it goes ahead without the recovery
    }
    {
        let mut listed = LISTED.lock();
        if listed.contains(&dir) {
            return;
        }
        // Bounded: an application walking a large tree does not grow this without limit (a
        // directory listed again after eviction is only checked again).
        if listed.len() >= MAX_LISTED_DIRS {
            listed.remove(0);
        }
        listed.push(dir.clone());
    }
    let prefix = if dir == "/" { dir.clone() } else { format!("{dir}/") };
    let missing: Vec<String> = {
        let mut slot = lock_state();
        let shim = match Shim::get(&mut slot) {
            Ok(s) => s,
            Err(e) => {
                log(&format!("opendir {dir}: nearlog is misconfigured: {e}"));
                return;
            }
        };
        match shim.ctl(&CtlRequest::Status) {
            Ok(CtlReply::Status(st)) => st
                .files
                .keys()
                .filter(|k| k.strip_prefix(&prefix).is_some_and(|name| !name.is_empty() && !name.contains('/')))
                .filter(|k| !std::path::Path::new(k.as_str()).exists())
                .cloned()
                .collect(),
            Ok(other) => {
                log(&format!("opendir {dir}: the controller answered Status with {other:?}"));
                return;
            }
            Err(e) => {
                log(&format!("opendir {dir}: cannot list the replicated log files: {e}"));
                return;
            }
        }
    };
    for key in missing {
        // Logs its own failure; the application's open of that file fails loudly later.
        let _ = sync_local_copy(&key, true);
    }
}

/// Directories [`before_opendir`] remembers as checked.
const MAX_LISTED_DIRS: usize = 1024;
static LISTED: ForkLock<Vec<String>> = ForkLock::new(Vec::new());

fn open_log(shim: &mut Shim, fd: c_int, key: &str, flags: c_int) -> Result<(), String> {
    if fd as usize >= MAX_TRACKED_FD {
        return Err(format!("fd {fd} is beyond the shim's table of {MAX_TRACKED_FD} fds"));
    }
    // SAFETY: fstat into a zeroed struct.
    let mut st: libc::stat64 = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat64(fd, &mut st) } != 0 {
        return Err(format!("fstat: {}", std::io::Error::last_os_error()));
    }
    let local_size = st.st_size as u64;
    let read_fd = reopen_readonly(fd)?;
    // Tell readers on this machine that a writer keeps this local copy current (released when
    // `read_fd` closes); waits while a reader repairs it.
    let until = Instant::now() + shim.cfg.deadline;
    loop {
        match writer_lock(read_fd, libc::F_RDLCK as libc::c_short, false) {
            Ok(true) => break,
            Ok(false) if Instant::now() < until => std::thread::sleep(Duration::from_millis(1)),
            other => {
                // SAFETY: our own fd, not stored anywhere yet.
                unsafe { close_own(read_fd) };
                return Err(format!("a reader on this machine holds the local copy's lock: {other:?}"));
            }
        }
    }
    let mut attempt = 0;
    let (grant, image) = loop {
        attempt += 1;
        let grant = match shim.ctl(&CtlRequest::Open { key: key.to_string(), replicas: 3 }) {
            Ok(CtlReply::Granted(g)) => g,
            Ok(_) => return Err("controller answered Open with something else".into()),
            Err(e) => {
                // SAFETY: our own fd, not stored anywhere yet.
                unsafe { close_own(read_fd) };
                return Err(e);
            }
        };
        shim.learn(&grant);
        // A copy this process made current (a writer closed it with every write acknowledged,
        // or it was recovered or verified for reading) and unchanged since: not read at all;
        // recovery only checks that a majority's most advanced copy is still that state.
        let known = if grant.initialized { known_copy(key, grant.file, &st) } else { None };
        // Otherwise the local copy as it is: the start of a file never replicated, and what
        // recovery may take verified chunks from instead of fetching them.
        let local = match known {
            Some(_) => Vec::new(),
            None => match read_local(read_fd, local_size) {
                Ok(l) => l,
                Err(e) => {
                    // SAFETY: our own fd, not stored anywhere yet.
                    unsafe { close_own(read_fd) };
                    return Err(format!("reading the local copy: {e}"));
                }
            },
        };
        let (initial, hint) = if grant.initialized { (Vec::new(), local) } else { (local, Vec::new()) };
        let ids = |v: &[nearlog::proto::PeerAddr]| v.iter().map(|p| p.id).collect::<Vec<_>>();
        let now = shim.now_us();
        let mut client = FileClient::open_moving(grant.file, grant.epoch, ids(&grant.peers), ids(&grant.recover_from), grant.initialized, initial, ClientConfig::default(), now)
            .with_local_copy(hint);
        if let Some(h) = known {
            client = client.with_known_state(h);
        }
        // A re-open after a failed attempt replaces (and keeps) the same read fd.
        if let Some(mut old) = shim.files.insert(fd, Tracked { key: key.to_string(), client, read_fd, owner_epoch: grant.epoch, resume: None, resumes: 0 }) {
            old.read_fd = -1;
        }
        match shim.wait_for(fd, false, |c| c.is_ready()) {
            Ok(()) => {}
            // A mover (reclaim) fenced our recovery: open again, it will follow.
            Err(_) if attempt < 4 && matches!(shim.files[&fd].client.failure(), Some(Failure::Fenced { .. })) => continue,
            Err(e) => return Err(format!("recovery of {key} (epoch {}): {e}", grant.epoch)),
        }
        let t = shim.files.get_mut(&fd).unwrap();
        let image = t.client.take_recovered().unwrap_or_default();
        if !grant.initialized || !grant.recover_from.is_empty() {
            // Marks the content as replicated, and ends a pending move (our Base is on the new set).
            shim.ctl(&CtlRequest::Initialized { key: key.to_string(), epoch: grant.epoch })?;
        }
        break (grant, image);
    };
    let _ = &grant;
    if flags & libc::O_TRUNC != 0 {
        // The real open already emptied the local file; the peers follow.
        let t = shim.files.get_mut(&fd).unwrap();
        let seq = t.client.submit(Op::Truncate { size: 0 }).map_err(|e| e.to_string())?;
        let _ = seq;
        shim.wait_for(fd, true, all_acked)?;
    } else {
        // Current when recovery took every chunk from the local copy (each checked against the
        // source's block checksums) and the sizes agree; a never-replicated file starts from it.
        let (fetched, _) = shim.files[&fd].client.recovery_bytes();
        let current = shim.files[&fd].client.matched_known() || (image.len() as u64 == local_size && (!grant.initialized || fetched == 0));
        if !current {
            // Missing, shorter, longer (unacknowledged tail) or different: the replicas win.
            write_local_all(fd, &image, 0).map_err(|e| format!("restoring the local copy: {e}"))?;
            // SAFETY: real ftruncate on our fd.
            if unsafe { (real().ftruncate)(fd, image.len() as off_t) } != 0 {
                return Err(format!("restoring the local copy: {}", std::io::Error::last_os_error()));
            }
            let (fetched, reused) = shim.files[&fd].client.recovery_bytes();
            log(&format!("recovered {key}: {} bytes from the log peers ({fetched} fetched, {reused} verified from the local copy of {local_size})", image.len()));
        }
    }
    INHERITED.set(fd, false);
    set_tracked(fd, true);
    Ok(())
}

fn with_tracked<T>(fd: c_int, f: impl FnOnce(&mut Shim, c_int) -> Result<T, String>, what: &str) -> Result<T, ()> {
    if INHERITED.has(fd) {
        log(&format!("{what} on log fd {fd}: EIO: a log file inherited across fork is not replicated by the child (it is its parent's)"));
        return Err(());
    }
    if foreign_child(&format!("{what} on log fd {fd}")) {
        return Err(());
    }
    let mut slot = lock_state();
    let Some(shim) = slot.as_mut() else {
        log(&format!("{what} on log fd {fd}: EIO: shim state is gone"));
        return Err(());
    };
    let primary = *shim.aliases.get(&fd).unwrap_or(&fd);
    f(shim, primary).map_err(|e| {
        log(&format!("{what} on log fd {fd}: EIO: {e}"));
    })
}

/// Replicates `data` written at `offset` and waits for a majority.
fn replicate(shim: &mut Shim, fd: c_int, offset: u64, data: &[u8]) -> Result<(), String> {
    let t0 = Instant::now();
    let now = shim.now_us();
    let t = shim.files.get_mut(&fd).ok_or("not a log fd")?;
    // The client's clock before the submit: a peer that had every record starts its
    // retransmission timer now, not at an ack long ago (which resent the record at once).
    t.client.handle(Input::Tick { now_us: now });
    for (i, chunk) in data.chunks(MAX_CHUNK_BYTES).enumerate() {
        t.client.submit(Op::write(offset + (i * MAX_CHUNK_BYTES) as u64, chunk.to_vec())).map_err(|e| e.to_string())?;
    }
    let r = shim.wait_for(fd, true, all_acked);
    if stats::enabled() {
        stats::add(&stats::REPLICATE_NS, Instant::now().duration_since(t0).as_nanos() as u64);
        stats::add(&stats::BYTES, data.len() as u64);
        if stats::WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % STATS_EVERY_WRITES == STATS_EVERY_WRITES - 1 {
            log(&stats::line());
        }
    }
    r
}

/// Every op submitted so far is on a majority (calls are synchronous: this is "ours is").
fn all_acked(c: &FileClient) -> bool {
    c.acked_seq() >= c.last_seq()
}

pub unsafe fn write(fd: c_int, buf: *const c_void, n: size_t, off: Option<off_t>) -> ssize_t {
    let r = real();
    if !is_tracked(fd) {
        return match off {
            None => (r.write)(fd, buf, n),
            Some(o) => (r.pwrite)(fd, buf, n, o),
        };
    }
    let Some(_g) = Guard::enter() else {
        reentrant_log_call();
        return -1;
    };
    let res = with_tracked(
        fd,
        |shim, pfd| {
            let done = match off {
                None => (r.write)(fd, buf, n),
                Some(o) => (r.pwrite)(fd, buf, n, o),
            };
            if done <= 0 {
                return Ok(done);
            }
            let offset = match off {
                Some(o) => o as u64,
                // After write(2) the file offset is just past the bytes (O_APPEND included).
                None => libc::lseek64(fd, 0, libc::SEEK_CUR) as u64 - done as u64,
            };
            let data = std::slice::from_raw_parts(buf as *const u8, done as usize);
            replicate(shim, pfd, offset, data)?;
            Ok(done)
        },
        "write",
    );
    res.unwrap_or_else(|()| {
        set_errno(take_fail_errno());
        -1
    })
}

pub unsafe fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    let r = real();
    if !is_tracked(fd) || cnt <= 0 {
        return (r.writev)(fd, iov, cnt);
    }
    let Some(_g) = Guard::enter() else {
        reentrant_log_call();
        return -1;
    };
    let res = with_tracked(
        fd,
        |shim, pfd| {
            let done = (r.writev)(fd, iov, cnt);
            if done <= 0 {
                return Ok(done);
            }
            let offset = libc::lseek64(fd, 0, libc::SEEK_CUR) as u64 - done as u64;
            let mut data = Vec::with_capacity(done as usize);
            for v in std::slice::from_raw_parts(iov, cnt as usize) {
                let take = (v.iov_len).min(done as usize - data.len());
                data.extend_from_slice(std::slice::from_raw_parts(v.iov_base as *const u8, take));
            }
            replicate(shim, pfd, offset, &data)?;
            Ok(done)
        },
        "writev",
    );
    res.unwrap_or_else(|()| {
        set_errno(take_fail_errno());
        -1
    })
}

pub enum SyncKind {
    Fsync,
    Fdatasync,
    Range(i64, i64, libc::c_uint),
}

pub unsafe fn sync(fd: c_int, kind: SyncKind) -> c_int {
    let r = real();
    if is_tracked(fd) {
        // Every acknowledged write is already on a majority of peers: durable without a flush.
        let Some(_g) = Guard::enter() else {
            reentrant_log_call();
            return -1;
        };
        let failed = with_tracked(fd, |shim, pfd| Ok(shim.files.get(&pfd).and_then(|t| t.client.failure().cloned())), "fsync");
        return match failed {
            Ok(None) => 0,
            Ok(Some(f)) => {
                log(&format!("fsync on log fd {fd}: EIO: {f}"));
                set_errno(libc::EIO);
                -1
            }
            Err(()) => {
                set_errno(libc::EIO);
                -1
            }
        };
    }
    match kind {
        SyncKind::Fsync => (r.fsync)(fd),
        SyncKind::Fdatasync => (r.fdatasync)(fd),
        SyncKind::Range(o, n, f) => (r.sync_file_range)(fd, o, n, f),
    }
}

pub unsafe fn ftruncate(fd: c_int, len: off_t) -> c_int {
    let r = real();
    if !is_tracked(fd) || len < 0 {
        return (r.ftruncate)(fd, len);
    }
    let Some(_g) = Guard::enter() else {
        reentrant_log_call();
        return -1;
    };
    let res = with_tracked(
        fd,
        |shim, pfd| {
            let rc = (r.ftruncate)(fd, len);
            if rc != 0 {
                return Ok(rc);
            }
            let t = shim.files.get_mut(&pfd).ok_or("not a log fd")?;
            t.client.submit(Op::Truncate { size: len as u64 }).map_err(|e| e.to_string())?;
            shim.wait_for(pfd, true, all_acked)?;
            Ok(0)
        },
        "ftruncate",
    );
    res.unwrap_or_else(|()| {
        set_errno(take_fail_errno());
        -1
    })
}

pub unsafe fn close(fd: c_int) -> c_int {
    if is_tracked(fd) {
        fd_going(fd);
    }
    (real().close)(fd)
}

/// Log fd `fd` is about to leave this process's fd table (close, or dup2/dup3 over it).
fn fd_going(fd: c_int) {
    if in_vfork_child() {
        return; // the bookkeeping is the parent's (shared memory); the fd table is the child's
    }
    if INHERITED.has(fd) {
        // A fork child's copy of its parent's log fd: nothing of it is the child's.
        INHERITED.set(fd, false);
        set_tracked(fd, false);
        return;
    }
    match Guard::enter() {
        Some(_g) => forget_fd(fd),
        None => {
            // A signal handler on a thread inside the shim (which holds the state's lock):
            // the fd stops being a log fd now, its state is forgotten by the lock's next holder.
            set_tracked(fd, false);
            PENDING_FORGET.set(fd, true);
            ANY_PENDING.store(true, Ordering::Release);
        }
    }
}

/// The shim's bookkeeping when `fd` stops naming a log file (close, or dup2/dup3 over it):
/// writes were acknowledged synchronously, so nothing is pending; if copies of the fd remain,
/// one of them takes over the replication state.
/// At process exit (`exit`, a return from `main`; not SIGKILL): the peers beyond the majority get
/// what was held back for them, and every log file whose writes were all acknowledged is
/// remembered as a known copy (as a close would), so the next run's writer open does not re-read
/// an application's log it never closed (Redis keeps its AOF open until it exits).
extern "C" fn at_exit() {
    let Some(_g) = Guard::enter() else { return };
    if in_vfork_child() {
        return; // exit (not _exit) in a vfork child: the state is its parent's
    }
    // Never wait at exit: a thread that holds the state (exit from another thread mid-write)
    // keeps it; nothing is remembered then.
    let Some(mut slot) = SHIM.try_lock() else { return };
    let Some(shim) = slot.as_mut() else { return };
    shim.flush_deferred();
    let done: Vec<(String, nearlog::proto::FileId, c_int, Option<nearlog::proto::Holding>)> = shim
        .files
        .values()
        .filter(|t| t.resume.is_none() && t.client.failure().is_none() && t.read_fd >= 0)
        .map(|t| (t.key.clone(), t.client.file(), t.read_fd, t.client.committed_state()))
        .collect();
    drop(slot);
    for (key, file, fd, state) in done {
        remember_copy(&key, file, fd, state);
    }
}

#[used]
#[link_section = ".fini_array"]
static AT_EXIT: extern "C" fn() = at_exit;

fn forget_fd(fd: c_int) {
    set_tracked(fd, false);
    let mut slot = lock_state();
    if let Some(shim) = slot.as_mut() {
        forget_locked(shim, fd);
    }
}

/// [`forget_fd`]'s work, with the state locked.
fn forget_locked(shim: &mut Shim, fd: c_int) {
    if shim.aliases.remove(&fd).is_some() {
        return;
    }
    let Some(t) = shim.files.remove(&fd) else { return };
    // The peers beyond the majority get what was held back for them before the file goes.
    shim.flush_deferred();
    let sent = t.client.image_bytes();
    if sent != Default::default() {
        log(&format!("{}: images sent to lagging log peers: {} bytes whole, {} bytes as patches of {} bytes of images", t.key, sent.whole, sent.patch, sent.patched_images));
    }
    if t.resume.is_none() && t.client.failure().is_none() && t.read_fd >= 0 {
        // Every write reached the local copy before it was acknowledged: the copy is exactly
        // the state a majority holds. A writer open of it in this process skips reading it
        // unless the file changed since (identity) or a client elsewhere moved the state on.
        remember_copy(&t.key, t.client.file(), t.read_fd, t.client.committed_state());
    }
    let copies: Vec<c_int> = shim.aliases.iter().filter(|(_, &p)| p == fd).map(|(&a, _)| a).collect();
    if let Some(&heir) = copies.iter().min() {
        shim.aliases.remove(&heir);
        for a in copies.into_iter().filter(|&a| a != heir) {
            shim.aliases.insert(a, heir);
        }
        shim.files.insert(heir, t);
    }
}

/// After a successful dup of log fd `old` into `new`: `new` replicates too, and like every log
/// fd it is close-on-exec. A copy beyond the fd table cannot be tracked: it is closed and the
/// call fails (EMFILE) rather than letting writes through it go unreplicated.
fn track_copy(old: c_int, new: c_int) -> c_int {
    if new as usize >= MAX_TRACKED_FD {
        log(&format!("dup of log fd {old}: EMFILE: fd {new} is beyond the shim's table of {MAX_TRACKED_FD} fds"));
        // SAFETY: closing the fd the dup just made.
        unsafe { (real().close)(new) };
        set_errno(libc::EMFILE);
        return -1;
    }
    set_cloexec(new);
    if in_vfork_child() {
        return new; // the copy is in the child's table only; it goes at the exec
    }
    if INHERITED.has(old) {
        INHERITED.set(new, true);
        set_tracked(new, true);
        return new;
    }
    let Some(_g) = Guard::enter() else {
        // A signal handler that interrupted the shim on this thread: the copy cannot join the
        // state now, and an untracked copy would write unreplicated.
        // SAFETY: closing the fd the dup just made.
        unsafe { (real().close)(new) };
        reentrant_log_call();
        return -1;
    };
    let mut slot = lock_state();
    if let Some(shim) = slot.as_mut() {
        let primary = *shim.aliases.get(&old).unwrap_or(&old);
        shim.aliases.insert(new, primary);
        set_tracked(new, true);
    }
    new
}

type FcntlFn = unsafe extern "C" fn(c_int, c_int, ...) -> c_int;
type Dup2Fn = unsafe extern "C" fn(c_int, c_int) -> c_int;
type Dup3Fn = unsafe extern "C" fn(c_int, c_int, c_int) -> c_int;

pub unsafe fn dup(old: c_int) -> c_int {
    let r = (real().dup)(old);
    if r < 0 || !is_tracked(old) {
        return r;
    }
    track_copy(old, r)
}

pub unsafe fn dup3(old: c_int, new: c_int, flags: c_int, three: bool) -> c_int {
    let call = || {
        if three {
            (real().dup3)(old, new, flags)
        } else {
            (real().dup2)(old, new)
        }
    };
    if old == new || !(is_tracked(old) || is_tracked(new)) {
        return call();
    }
    let r = call();
    if r < 0 {
        return r;
    }
    // `new` was closed by the call if it was open: forget it first, then track the copy.
    if is_tracked(new) {
        fd_going(new);
    }
    if is_tracked(old) {
        return track_copy(old, new);
    }
    r
}

pub unsafe fn fcntl(fd: c_int, cmd: c_int, arg: libc::c_ulong, name: &'static [u8]) -> c_int {
    // glibc's fcntl/fcntl64 are variadic with one optional integer-or-pointer argument, passed
    // here in the same register it arrived in.
    let f = if name == b"fcntl64\0" { real().fcntl64 } else { real().fcntl };
    let mut arg = arg;
    if cmd == libc::F_SETFD && arg & libc::FD_CLOEXEC as libc::c_ulong == 0 && is_tracked(fd) {
        // A log fd stays close-on-exec (see the crate doc): an exec'd program has no shim state
        // for it, and what it wrote would be in no peer's copy.
        if let Some(_g) = Guard::enter() {
            log(&format!("fcntl(F_SETFD) clearing close-on-exec on log fd {fd}: kept close-on-exec (a log fd does not cross exec)"));
        }
        arg |= libc::FD_CLOEXEC as libc::c_ulong;
    }
    let r = f(fd, cmd, arg);
    if r < 0 || !(cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC) || !is_tracked(fd) {
        return r;
    }
    track_copy(fd, r)
}

/// A writable shared mapping of a log file would change it behind the shim's back: refused
/// loudly (ENODEV, as for a file system without mmap). Private or read-only mappings pass.
pub unsafe fn mmap(addr: *mut c_void, len: size_t, prot: c_int, flags: c_int, fd: c_int, off: off_t) -> *mut c_void {
    if fd >= 0 && is_tracked(fd) && prot & libc::PROT_WRITE != 0 && flags & libc::MAP_SHARED != 0 {
        if let Some(_g) = Guard::enter() {
            log(&format!("mmap of log fd {fd} with PROT_WRITE|MAP_SHARED: ENODEV: writes through a mapping cannot be replicated; use write/pwrite"));
        }
        set_errno(libc::ENODEV);
        return libc::MAP_FAILED;
    }
    // The raw system call: no dlsym (which may allocate, and malloc may map memory).
    let r = libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, off);
    r as *mut c_void
}

/// Tells the peers of a forgotten file to free its memory (best effort: a peer that misses it
/// holds bytes of a file nobody will open again until it restarts).
fn drop_on_peers(shim: &mut Shim, g: &FileGrant) {
    shim.flush_deferred();
    for p in &g.peers {
        shim.peers.entry(p.id).or_insert_with(|| (p.addr.clone(), None, Instant::now() - Duration::from_secs(1)));
        if let Some(conn) = shim.ensure_conn(p.id) {
            // The reply is read (and ignored: no open file has this id) by a later pump.
            let _ = blocking::send(conn, &PeerRequest::Drop { file: g.file, epoch: g.epoch });
        }
    }
}

pub unsafe fn unlink_at(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    let r = real();
    let Some(_g) = Guard::enter() else { return (r.unlinkat)(dirfd, path, flags) };
    if path.is_null() || patterns().is_empty() && !UNPATTERNED_KEYS.load(Ordering::Relaxed) {
        return (r.unlinkat)(dirfd, path, flags);
    }
    let rc = (r.unlinkat)(dirfd, path, flags);
    if rc != 0 {
        return rc;
    }
    if let Some(abs) = absolute(dirfd, CStr::from_ptr(path)) {
        forget(&abs, None);
    }
    rc
}

/// Updates the controller after an unlink (`to == None`) or rename of `from`. Paths that are
/// no log file's pass without a lock ([`UNPATTERNED_KEYS`]).
fn forget(from: &str, to: Option<&str>) {
    let (from_log, to_log) = (is_log_path(from), to.is_some_and(is_log_path));
    if !from_log && !to_log && !UNPATTERNED_KEYS.load(Ordering::Relaxed) {
        return;
    }
    if foreign_child(&format!("{} of {from}: not reported to the controller", if to.is_some() { "rename" } else { "unlink" })) {
        return; // the file system's change is done; the controller's entry stays as it was
    }
    if to.is_some() && from_log && !to_log {
        UNPATTERNED_KEYS.store(true, Ordering::Relaxed); // a log file renamed out of the patterns
    }
    let mut slot = lock_state();
    let Ok(shim) = Shim::get(&mut slot) else { return };
    for k in std::iter::once(from).chain(to) {
        if let Some(p) = known_path(k) {
            let _ = std::fs::remove_file(p);
        }
    }
    let req = match to {
        None => CtlRequest::Remove { key: from.to_string() },
        Some(to) => CtlRequest::Rename { from: from.to_string(), to: to.to_string() },
    };
    match shim.ctl(&req) {
        Ok(CtlReply::Forgotten(Some(g))) => drop_on_peers(shim, &g),
        Ok(_) => {}
        Err(e) => log(&format!("{req:?}: {e} (the peers keep the file's bytes)")),
    }
    if let Some(to) = to {
        for t in shim.files.values_mut().filter(|t| t.key == from) {
            t.key = to.to_string();
        }
    }
}

pub unsafe fn rename(from: *const c_char, to: *const c_char) -> c_int {
    let r = real();
    let Some(_g) = Guard::enter() else { return (r.rename)(from, to) };
    let rc = (r.rename)(from, to);
    if rc != 0 || from.is_null() || to.is_null() {
        return rc;
    }
    if let (Some(a), Some(b)) = (absolute(libc::AT_FDCWD, CStr::from_ptr(from)), absolute(libc::AT_FDCWD, CStr::from_ptr(to))) {
        forget(&a, Some(&b));
    }
    rc
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("*-wal", "/x/db.sqlite-wal"));
        assert!(glob_match("*.aof*", "/d/appendonly.aof.1.incr.aof"));
        assert!(!glob_match("*.log", "/d/x.logs"));
        assert!(glob_match("/d/?.log", "/d/a.log"));
        assert_eq!(normalize("/a/./b/../c//d"), "/a/c/d");
    }

    #[test]
    fn known_copy_records_stay_within_their_bounds_oldest_removed_first() {
        let dir = std::env::temp_dir().join(format!("nearlog-known-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let d = dir.to_str().unwrap();
        let names: Vec<String> = (0..6).map(|i| format!("{d}/r{i}")).collect();
        for (i, n) in names.iter().enumerate() {
            assert!(make_room_for_record(d, n, 100, (4, 1000)));
            std::fs::write(n, vec![b'x'; 100]).unwrap();
            // Distinct modification times, oldest first.
            let t = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + i as u64);
            std::fs::File::options().write(true).open(n).unwrap().set_modified(t).unwrap();
        }
        let left = |d: &std::path::Path| {
            let mut v: Vec<String> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
            v.sort();
            v
        };
        assert_eq!(left(&dir), ["r2", "r3", "r4", "r5"], "at most 4 records, the oldest went");
        // A byte bound: 250 bytes hold two records of 100 beside a new one of 50.
        assert!(make_room_for_record(d, &format!("{d}/new"), 50, (10, 250)));
        assert_eq!(left(&dir), ["r4", "r5"]);
        // Rewriting a key's own record does not count that record; one larger than the bound does not fit.
        assert!(make_room_for_record(d, &names[5], 100, (2, 250)));
        assert_eq!(left(&dir), ["r4", "r5"]);
        assert!(!make_room_for_record(d, &format!("{d}/huge"), 300, (10, 250)));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
