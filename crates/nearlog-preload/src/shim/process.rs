//! Processes, locks and signals (the crate doc's audit): glibc's own functions, the
//! per-thread reentrancy guard, the lock-free fd bitmaps, the pid and vfork tests, the load-time
//! initialisation and the `pthread_atfork` handlers.

use super::*;

pub(super) type OpenAtFn = unsafe extern "C" fn(c_int, *const c_char, c_int, mode_t) -> c_int;
pub(super) type WriteFn = unsafe extern "C" fn(c_int, *const c_void, size_t) -> ssize_t;
pub(super) type PwriteFn = unsafe extern "C" fn(c_int, *const c_void, size_t, off_t) -> ssize_t;
pub(super) type WritevFn = unsafe extern "C" fn(c_int, *const iovec, c_int) -> ssize_t;
pub(super) type FdFn = unsafe extern "C" fn(c_int) -> c_int;
pub(super) type SfrFn = unsafe extern "C" fn(c_int, i64, i64, libc::c_uint) -> c_int;
pub(super) type TruncFn = unsafe extern "C" fn(c_int, off_t) -> c_int;
pub(super) type UnlinkAtFn = unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int;
pub(super) type RenameFn = unsafe extern "C" fn(*const c_char, *const c_char) -> c_int;

pub(crate) struct Real {
    pub(super) openat: OpenAtFn,
    pub(super) write: WriteFn,
    pub(super) pwrite: PwriteFn,
    pub(super) writev: WritevFn,
    pub(super) fsync: FdFn,
    pub(super) fdatasync: FdFn,
    pub(super) sync_file_range: SfrFn,
    pub(super) ftruncate: TruncFn,
    pub(super) close: FdFn,
    pub(super) unlinkat: UnlinkAtFn,
    pub(super) rename: RenameFn,
    pub(super) dup: FdFn,
    pub(super) dup2: Dup2Fn,
    pub(super) dup3: Dup3Fn,
    pub(super) fcntl: FcntlFn,
    pub(super) fcntl64: FcntlFn,
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
    pub(super) static IN_SHIM: Cell<bool> = const { Cell::new(false) };
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
    pub(super) fn enter() -> Option<Guard> {
        IN_SHIM.with(|g| if g.replace(true) { None } else { Some(Guard) })
    }
}
impl Drop for Guard {
    fn drop(&mut self) {
        IN_SHIM.with(|g| g.set(false));
    }
}

/// A set of fds as a bitmap of atomics: read and changed without a lock (async-signal-safe).
pub(super) struct FdSet(pub(super) [AtomicU64; MAX_TRACKED_FD / 64]);

impl FdSet {
    const fn new() -> FdSet {
        FdSet([const { AtomicU64::new(0) }; MAX_TRACKED_FD / 64])
    }
    pub(super) fn has(&self, fd: c_int) -> bool {
        fd >= 0 && (fd as usize) < MAX_TRACKED_FD && self.0[fd as usize / 64].load(Ordering::Relaxed) & (1 << (fd % 64)) != 0
    }
    pub(super) fn set(&self, fd: c_int, on: bool) {
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
pub(super) const MAX_TRACKED_FD: usize = 65536;
/// Fds that are log files (the fast path for every other fd takes no lock).
pub(super) static TRACKED: FdSet = FdSet::new();
/// In a fork child: the log fds it inherited (a subset of [`TRACKED`], set by
/// [`after_fork_child`]). They are the parent's to replicate, not the child's: a write, sync or
/// truncate on one fails with EIO, a close only clears its bits; no lock either way.
pub(super) static INHERITED: FdSet = FdSet::new();
/// Log fds closed (or replaced by dup2) from a signal handler that interrupted its own thread
/// inside the shim, which holds the state's lock: the next holder of the lock forgets them
/// ([`lock_state`]). [`ANY_PENDING`] saves every other holder the scan.
pub(super) static PENDING_FORGET: FdSet = FdSet::new();
pub(super) static ANY_PENDING: AtomicBool = AtomicBool::new(false);
/// The replication state's own long-lived fds: peer connections and the read fds of log files
/// (set once open, cleared before closing, so a set bit always names one of them). A fork child
/// closes its copies ([`after_fork_child`]): the parent's connections are not the child's to
/// keep open (a peer would not see the parent go while a child lives), and a read fd's lock on
/// [`WRITER_LOCK_BYTE`] says "a writer on this machine keeps this local copy current", which
/// must end with that writer, not with its longest-lived child.
pub(super) static OWN_FDS: FdSet = FdSet::new();

/// Closes one of the state's own fds ([`OWN_FDS`]).
pub(super) unsafe fn close_own(fd: c_int) {
    OWN_FDS.set(fd, false);
    (real().close)(fd);
}

pub(super) fn is_tracked(fd: c_int) -> bool {
    TRACKED.has(fd)
}
pub(super) fn set_tracked(fd: c_int, on: bool) {
    TRACKED.set(fd, on)
}

/// The controller may know log files by names no pattern matches: set once this process opens
/// a file with [`O_NCL`] or renames a log file to a name outside the patterns. Until then a
/// rename or unlink of a path the patterns do not name is none of the shim's business: it
/// passes through without a lock or a controller round trip.
pub(super) static UNPATTERNED_KEYS: AtomicBool = AtomicBool::new(false);

/// This process's id, kept without a system call: set at load ([`init_at_load`]) and by the
/// fork child handler. A `vfork` child (no fork handlers run; it shares its parent's memory)
/// still finds its parent's id here: that is how [`in_vfork_child`] tells.
pub(super) static PID: AtomicU32 = AtomicU32::new(0);

pub(super) fn pid() -> u32 {
    match PID.load(Ordering::Relaxed) {
        0 => std::process::id(), // not loaded through `init_at_load` (the rlib in unit tests)
        p => p,
    }
}

/// True in a `vfork` (or other `CLONE_VM`) child before it execs: it shares the parent's
/// memory (bitmaps, state, locks) but has its own fd table, so a close or dup there must not
/// touch the parent's bookkeeping. One `getpid` system call (about 0.2 µs here), only on the
/// paths of log fds and log paths, never on the fast path of other fds.
pub(super) fn in_vfork_child() -> bool {
    let p = PID.load(Ordering::Relaxed);
    // SAFETY: no arguments (glibc does not cache the pid: this is the kernel's answer).
    p != 0 && unsafe { libc::getpid() } as u32 != p
}

/// A child made without fork's handlers (vfork, `clone`, a raw fork system call) never uses
/// the state it finds in memory — its parent's, shared (vfork) or a copy whose sockets the
/// parent goes on using, whose lock may be held for good. A log operation there fails (EIO),
/// said once on stderr. Costs one `getpid` per log operation (a replicated write costs tens of
/// µs).
pub(super) fn foreign_child(what: &str) -> bool {
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
pub(super) extern "C" fn init_at_load() {
    PID.store(std::process::id(), Ordering::Relaxed);
    let _ = real();
    let _ = patterns();
    // SAFETY: registers three handlers that only use atomics, ForkLocks and system calls.
    unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork_parent), Some(after_fork_child)) };
}

#[used]
#[link_section = ".init_array"]
pub(super) static INIT_AT_LOAD: extern "C" fn() = init_at_load;

thread_local! {
    /// Set by [`before_fork`] on the forking thread when it took the short locks (the parent
    /// and child handlers run on that thread and release them).
    pub(super) static HELD_FOR_FORK: Cell<bool> = const { Cell::new(false) };
}

/// The fork prepare handler. The short locks (stdio's stream table, the known copies, the
/// listed directories; held for microseconds to a few tmpfs operations, never across network
/// I/O) are taken in this fixed order, so the child inherits them consistent and free. The
/// state's lock [`SHIM`] is not: it is held across replication round trips (up to
/// `UNDERSTUDY_NEARLOG_DEADLINE_MS`), and a fork must not wait for those; the child replaces
/// that state instead. A fork from a signal handler that interrupted this thread inside the
/// shim takes nothing (this thread may hold any of them): the child then resets every one.
pub(super) extern "C" fn before_fork() {
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

pub(super) extern "C" fn after_fork_parent() {
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
pub(super) extern "C" fn after_fork_child() {
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
pub(super) fn reentrant_log_call() {
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
pub(super) fn set_cloexec(fd: c_int) {
    // SAFETY: fcntl on an fd with integer arguments (the raw call: no interposed fcntl).
    unsafe { libc::syscall(libc::SYS_fcntl, fd, libc::F_SETFD, libc::FD_CLOEXEC) };
}

pub(super) fn log(msg: &str) {
    let line = format!("[nearlog {}] {msg}\n", std::process::id());
    // SAFETY: writing a valid buffer to stderr with the real write.
    unsafe {
        (real().write)(2, line.as_ptr() as *const c_void, line.len());
    }
}

pub(super) fn set_errno(e: c_int) {
    // SAFETY: errno is thread-local and always valid to write.
    unsafe { *libc::__errno_location() = e };
}
