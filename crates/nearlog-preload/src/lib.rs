//! LD_PRELOAD shim of the near-compute log (SplitFT's "NCL library"): an unmodified
//! application's log files are replicated to nearlog peers; everything else passes through.
//!
//! A file is a log file when it is opened with [`O_NCL`] (`0o40000000`, a bit Linux leaves
//! unused; stripped before the real `open`) or when its absolute path matches one of the
//! colon-separated glob patterns in `UNDERSTUDY_NEARLOG_PATTERNS` (`*` any run of characters,
//! `?` one; e.g. `*-wal:*.incr.aof`). The cluster comes from `UNDERSTUDY_NEARLOG_CLUSTER` (the
//! `nearlog-cluster.json` of `understudy nearlog up`).
//!
//! - open/openat/creat (and 64-bit forms) of a log file for writing: the controller grants a new
//!   epoch, the content is recovered from a majority of peers ([`nearlog::core::file_client::FileClient`])
//!   and written to the local file when the local copy is missing, shorter or different.
//! - A read-only open (and `fopen` for reading) verifies the local copy against a majority of
//!   peers first without taking an epoch (a live writer is not fenced): only chunks whose block
//!   checksums differ are fetched and rewritten; a current copy costs a lookup, a probe round
//!   and the source's checksums. A writer through the shim on this machine (an OFD lock on a
//!   byte far past the end) keeps its local copy current, so readers there leave it alone.
//! - write/pwrite/writev: the bytes go to the local file (page cache, no fsync) and to the
//!   file's peers; the call returns once a majority holds them. fsync/fdatasync/sync_file_range
//!   then cost nothing. ftruncate is replicated; unlink and rename update the controller and
//!   free the peers' memory.
//! - While waiting for a majority the calling thread polls without sleeping for up to
//!   `UNDERSTUDY_NEARLOG_SPIN_US` (default 50, at most 10000; 0 = always block in `poll`).
//! - Local copies known to be current (closed with every write acknowledged, or still open at
//!   process exit, or made current by a recovery) are remembered on tmpfs, at most
//!   `UNDERSTUDY_NEARLOG_KNOWN_MAX_RECORDS` (default 1024) records and
//!   `UNDERSTUDY_NEARLOG_KNOWN_MAX_BYTES` (default 1 MiB), the oldest removed first.
//! - No majority within `UNDERSTUDY_NEARLOG_DEADLINE_MS` (default 10000): EIO. A missing or bad
//!   configuration or an unreachable controller: EIO at open, with a line on stderr — never
//!   silently unreplicated writes.
//!
//! No tokio: std blocking sockets and `poll(2)`, driven by the calling thread under one lock.
//! Reentrancy (the shim's own I/O) passes through via a thread-local guard.
//! dup/dup2/dup3/fcntl(F_DUPFD, F_DUPFD_CLOEXEC) of a log fd make another fd that replicates
//! through the same state (closing the original keeps the copy replicating); a writable shared
//! mmap of a log fd is refused loudly (ENODEV). `opendir` of a directory recovers the
//! replicated log files it lacks before the listing. stdio: `fopen`/`fopen64` of a log file for
//! writing, and `fdopen` of a log fd, give a stream whose writes (at `fflush` or a full buffer)
//! replicate like `write`; `fileno` of it is a log fd (so `fsync(fileno(f))` works).
//!
//! # Processes, locks and signals
//!
//! A log fd belongs to the process that opened it. The rules below keep every call of a
//! process that forks, spawns, execs or handles signals from waiting on a lock nobody will
//! release, and keep every acknowledged write on the peers.
//!
//! - **Locks.** The shim takes four locks, all `ForkLock`s (`forklock.rs`; the guard, the bitmaps
//!   and the fork handlers are in `shim/process.rs`): the replication state
//!   (held across round trips to the peers), stdio's stream table, the known copies and the
//!   listed directories (each held for microseconds, never across network I/O). Calls on fds
//!   that are not log fds (write, close, fsync, ftruncate, dup, fcntl, mmap) test a lock-free
//!   bitmap and take none; rename and unlink of paths no pattern names take none either (once
//!   the process opened a file with `O_NCL`, or renamed a log file to a name outside the
//!   patterns, every rename and unlink is reported to the controller, as opt-in names are the
//!   controller's to know). open, stat and fopen of such paths only match the patterns. The one
//!   exception: the first `opendir` of each directory in a process asks the controller which
//!   log files it should hold (under the state's lock; see above). Every shim lock is taken
//!   inside the thread's reentrancy guard, so
//!   a thread never waits for a lock it holds itself (see signal handlers). glibc's functions
//!   are resolved and the patterns read at load, before `main`; other lazily initialised
//!   settings are finished by the fork prepare handler. The shim's own dependencies take no
//!   lock of their own on these paths (the nearlog client is sans-I/O; std's sockets, files and
//!   clock take none; std's environment lock is only ever read).
//! - **fork.** `pthread_atfork` handlers: prepare takes the three short locks in a fixed order
//!   (streams, known copies, listed directories), parent and child release them, so the child
//!   inherits them free and consistent. The replication state's lock is not taken (a fork
//!   would wait up to `UNDERSTUDY_NEARLOG_DEADLINE_MS` behind a slow write): the child handler
//!   replaces that state with an empty one (no allocation, no reading of the old, which another
//!   thread may have been changing). So the child starts with no replication state: a log file
//!   it opens itself gets its own epoch and its own connections, made lazily; a log fd it
//!   inherited is its parent's: write, writev, pwrite, fsync, fdatasync, sync_file_range and
//!   ftruncate on it fail with EIO (with a line on stderr), close (or dup2 over it) just
//!   forgets it, a dup of it is inherited too; none of it takes a lock. rename/unlink of a
//!   log file in the child reach the controller on the child's own connection. (Redis's
//!   rewrite and BGSAVE children write a temp file and rename it: none of that is a log file.)
//!   The child closes its copies of the parent state's own fds (peer connections, and the
//!   read fds whose lock tells local readers that a writer keeps the copy current).
//! - **vfork / posix_spawn.** glibc's `posix_spawn` child calls the system calls directly
//!   (no interposed function runs there); its exec drops every log fd (below) — except one
//!   `posix_spawn_file_actions_adddup2` copies onto another number, which the shim never sees.
//!   A `vfork` child shares the parent's memory but has its own fd table: close, dup2, dup3,
//!   dup and F_DUPFD there leave the parent's bookkeeping alone (told by `getpid` differing
//!   from the pid the shim keeps), so the parent's log fds go on replicating. Any child made
//!   without fork's handlers (vfork, `clone`, a raw fork system call) never uses the state it
//!   finds in memory: a log write, sync, truncate or open there fails with EIO, and a rename
//!   or unlink of a log file is done but not reported to the controller (logged) — POSIX
//!   allows a vfork child only exec and `_exit`.
//! - **exec.** Log fds are close-on-exec: the shim opens them with `O_CLOEXEC` and sets it on
//!   every copy (also a dup2/dup3 copy POSIX would make inheritable), and keeps it when
//!   `fcntl(F_SETFD)` would clear it (logged). An exec'd program has no shim state for such an
//!   fd and its writes would be in no peer's copy (the next writer open would discard them as
//!   an unacknowledged tail), so it does not get one: its use of that fd number fails EBADF.
//!   The shim's own sockets and read fds are close-on-exec too.
//! - **Signal handlers.** The lock-free paths above serve a handler that writes to a pipe or
//!   socket, closes a non-log fd, and so on. A handler that uses a log fd while its own thread
//!   was interrupted inside the shim (which holds the state's lock) cannot wait for that lock
//!   and must not write unreplicated: write/writev/fsync/ftruncate fail with EIO (a constant
//!   line on stderr, once per process), a dup of a log fd fails with EIO, and a close (or dup2
//!   over a log fd) takes effect at once while the state forgets the fd when its lock is next
//!   taken. A handler on a thread not inside the shim waits for the lock like any thread.
//!   Resolving a path (open, stat, rename, unlink with patterns set) allocates, so a handler
//!   that interrupts `malloc` and calls those may still deadlock in the allocator.

#![allow(clippy::missing_safety_doc)]

mod forklock;
mod shim;
mod stdio;

use std::ffi::c_char;

use libc::{c_int, c_void, iovec, mode_t, off64_t, off_t, size_t, ssize_t};

/// The opt-in open flag: a bit no Linux `open` flag uses.
pub const O_NCL: c_int = 0o40000000;

pub use shim::glob_match;

type FopenFn = unsafe extern "C" fn(*const c_char, *const c_char) -> *mut libc::FILE;

unsafe fn real_fopen(name: &[u8], path: *const c_char, mode: *const c_char) -> *mut libc::FILE {
    // SAFETY: glibc's fopen/fopen64 have this signature.
    let f = std::mem::transmute::<*mut c_void, FopenFn>(libc::dlsym(libc::RTLD_NEXT, name.as_ptr() as *const c_char));
    f(path, mode)
}

/// stdio opens: a log file opened for writing becomes a stream whose writes replicate
/// (`stdio`); an open for reading (Redis reads its AOF with `fopen`) verifies the local copy
/// against the peers first, like a read-only `open`.
#[no_mangle]
pub unsafe extern "C" fn fopen(path: *const c_char, mode: *const c_char) -> *mut libc::FILE {
    match stdio::fopen(path, mode) {
        stdio::Open::Pass => real_fopen(b"fopen\0", path, mode),
        stdio::Open::Fail => std::ptr::null_mut(),
        stdio::Open::Stream(f) => f,
    }
}
#[no_mangle]
pub unsafe extern "C" fn fopen64(path: *const c_char, mode: *const c_char) -> *mut libc::FILE {
    match stdio::fopen(path, mode) {
        stdio::Open::Pass => real_fopen(b"fopen64\0", path, mode),
        stdio::Open::Fail => std::ptr::null_mut(),
        stdio::Open::Stream(f) => f,
    }
}

type FdopenFn = unsafe extern "C" fn(c_int, *const c_char) -> *mut libc::FILE;
type FilenoFn = unsafe extern "C" fn(*mut libc::FILE) -> c_int;

/// `fdopen` of a log fd: a stream whose writes replicate.
#[no_mangle]
pub unsafe extern "C" fn fdopen(fd: c_int, mode: *const c_char) -> *mut libc::FILE {
    if let Some(f) = stdio::fdopen(fd, mode) {
        return f;
    }
    // SAFETY: glibc's fdopen has this signature.
    std::mem::transmute::<usize, FdopenFn>(shim::real().fdopen)(fd, mode)
}

/// The fd of a replicated stream (a cookie stream has none of its own), else glibc's answer.
#[no_mangle]
pub unsafe extern "C" fn fileno(f: *mut libc::FILE) -> c_int {
    if let Some(fd) = stdio::stream_fd(f) {
        return fd;
    }
    // SAFETY: glibc's fileno has this signature.
    std::mem::transmute::<usize, FilenoFn>(shim::real().fileno)(f)
}
#[no_mangle]
pub unsafe extern "C" fn fileno_unlocked(f: *mut libc::FILE) -> c_int {
    if let Some(fd) = stdio::stream_fd(f) {
        return fd;
    }
    // SAFETY: glibc's fileno_unlocked has this signature.
    std::mem::transmute::<usize, FilenoFn>(shim::real().fileno_unlocked)(f)
}

// The C `open`/`openat` are variadic; on x86_64 and aarch64 Linux the optional `mode` argument
// travels in the same register as a fixed third (fourth) argument would, so declaring it fixed
// reads it correctly (garbage when the caller passed none, and then it is unused: the kernel
// reads mode only with O_CREAT/O_TMPFILE).

#[no_mangle]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    shim::open_at(libc::AT_FDCWD, path, flags, mode)
}
#[no_mangle]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    shim::open_at(libc::AT_FDCWD, path, flags, mode)
}
#[no_mangle]
pub unsafe extern "C" fn openat(dirfd: c_int, path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    shim::open_at(dirfd, path, flags, mode)
}
#[no_mangle]
pub unsafe extern "C" fn openat64(dirfd: c_int, path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    shim::open_at(dirfd, path, flags, mode)
}
#[no_mangle]
pub unsafe extern "C" fn creat(path: *const c_char, mode: mode_t) -> c_int {
    shim::open_at(libc::AT_FDCWD, path, libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC, mode)
}
#[no_mangle]
pub unsafe extern "C" fn creat64(path: *const c_char, mode: mode_t) -> c_int {
    shim::open_at(libc::AT_FDCWD, path, libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC, mode)
}
#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    shim::write(fd, buf, n, None)
}
#[no_mangle]
pub unsafe extern "C" fn pwrite(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> ssize_t {
    shim::write(fd, buf, n, Some(off))
}
#[no_mangle]
pub unsafe extern "C" fn pwrite64(fd: c_int, buf: *const c_void, n: size_t, off: off64_t) -> ssize_t {
    shim::write(fd, buf, n, Some(off))
}
#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    shim::writev(fd, iov, cnt)
}
#[no_mangle]
pub unsafe extern "C" fn fsync(fd: c_int) -> c_int {
    shim::sync(fd, shim::SyncKind::Fsync)
}
#[no_mangle]
pub unsafe extern "C" fn fdatasync(fd: c_int) -> c_int {
    shim::sync(fd, shim::SyncKind::Fdatasync)
}
#[no_mangle]
pub unsafe extern "C" fn sync_file_range(fd: c_int, off: off64_t, n: off64_t, flags: libc::c_uint) -> c_int {
    shim::sync(fd, shim::SyncKind::Range(off, n, flags))
}
#[no_mangle]
pub unsafe extern "C" fn ftruncate(fd: c_int, len: off_t) -> c_int {
    shim::ftruncate(fd, len)
}
#[no_mangle]
pub unsafe extern "C" fn ftruncate64(fd: c_int, len: off64_t) -> c_int {
    shim::ftruncate(fd, len)
}
#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    shim::close(fd)
}
#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    shim::dup(fd)
}
#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    shim::dup3(old, new, 0, false)
}
#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    shim::dup3(old, new, flags, true)
}
// `fcntl` is variadic like `open`: the optional argument is read from its register.
#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
    shim::fcntl(fd, cmd, arg, b"fcntl\0")
}
#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
    shim::fcntl(fd, cmd, arg, b"fcntl64\0")
}
#[no_mangle]
pub unsafe extern "C" fn mmap(addr: *mut c_void, len: size_t, prot: c_int, flags: c_int, fd: c_int, off: off_t) -> *mut c_void {
    shim::mmap(addr, len, prot, flags, fd, off)
}
#[no_mangle]
pub unsafe extern "C" fn mmap64(addr: *mut c_void, len: size_t, prot: c_int, flags: c_int, fd: c_int, off: off64_t) -> *mut c_void {
    shim::mmap(addr, len, prot, flags, fd, off)
}
#[no_mangle]
pub unsafe extern "C" fn unlink(path: *const c_char) -> c_int {
    shim::unlink_at(libc::AT_FDCWD, path, 0)
}
#[no_mangle]
pub unsafe extern "C" fn unlinkat(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    shim::unlink_at(dirfd, path, flags)
}
#[no_mangle]
pub unsafe extern "C" fn rename(from: *const c_char, to: *const c_char) -> c_int {
    shim::rename(from, to)
}

type OpendirFn = unsafe extern "C" fn(*const c_char) -> *mut c_void;

/// Listing a directory recovers the replicated log files it lacks first (see
/// `shim::before_opendir`): an application that lists its log directory at start (RocksDB)
/// finds them on a new machine.
#[no_mangle]
pub unsafe extern "C" fn opendir(path: *const c_char) -> *mut c_void {
    shim::before_opendir(path);
    // SAFETY: glibc's opendir has this signature (DIR* is opaque here).
    std::mem::transmute::<usize, OpendirFn>(shim::real().opendir)(path)
}

type StatFn = unsafe extern "C" fn(*const c_char, *mut c_void) -> c_int;

unsafe fn real_stat(name: &[u8], path: *const c_char, buf: *mut c_void) -> c_int {
    // SAFETY: glibc's stat family have this signature (the buffer type is opaque here).
    let f = std::mem::transmute::<*mut c_void, StatFn>(libc::dlsym(libc::RTLD_NEXT, name.as_ptr() as *const c_char));
    f(path, buf)
}

/// `stat` of a missing log file recovers it first (Redis checks its AOF's length with stat
/// before reading it).
#[no_mangle]
pub unsafe extern "C" fn stat(path: *const c_char, buf: *mut c_void) -> c_int {
    let _ = shim::before_read(path, true);
    real_stat(b"stat\0", path, buf)
}
#[no_mangle]
pub unsafe extern "C" fn stat64(path: *const c_char, buf: *mut c_void) -> c_int {
    let _ = shim::before_read(path, true);
    real_stat(b"stat64\0", path, buf)
}
