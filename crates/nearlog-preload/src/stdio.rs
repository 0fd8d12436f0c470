//! stdio streams on log files. glibc's `FILE` writes with its internal `__write`, which an
//! LD_PRELOAD `write` never sees; so a log file opened for writing with `fopen`/`fopen64` (or a
//! log fd wrapped with `fdopen`) becomes a `fopencookie` stream whose write function is the
//! shim's replicated `write` on an fd opened through the shim. `fflush` (and a full buffer)
//! therefore returns once a majority holds the bytes; `fileno` of such a stream answers that fd,
//! so `fsync(fileno(f))` works as with any stream (and costs nothing more).

use std::collections::HashMap;
use std::ffi::{c_char, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::forklock::ForkLock;

use libc::{c_int, c_void, off64_t, size_t, ssize_t, FILE};

#[repr(C)]
struct CookieIoFunctions {
    read: Option<unsafe extern "C" fn(*mut c_void, *mut c_char, size_t) -> ssize_t>,
    write: Option<unsafe extern "C" fn(*mut c_void, *const c_char, size_t) -> ssize_t>,
    seek: Option<unsafe extern "C" fn(*mut c_void, *mut off64_t, c_int) -> c_int>,
    close: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
}

extern "C" {
    fn fopencookie(cookie: *mut c_void, mode: *const c_char, funcs: CookieIoFunctions) -> *mut FILE;
}

/// Streams made here -> their fd (for `fileno`). `COUNT` lets every other `fileno` skip the lock.
/// One of the shim's short locks: the fork handlers take it first ([`lock_for_fork`]).
static STREAMS: ForkLock<Option<HashMap<usize, c_int>>> = ForkLock::new(None);
static COUNT: AtomicUsize = AtomicUsize::new(0);

/// The fd behind a stream made here, if it is one.
pub fn stream_fd(f: *mut FILE) -> Option<c_int> {
    if COUNT.load(Ordering::Relaxed) == 0 {
        return None;
    }
    // Inside the shim's guard, like every shim lock: a signal handler that interrupts this
    // thread here (or a fork from one) then never waits for the lock this thread holds.
    let _g = crate::shim::enter()?;
    STREAMS.lock().as_ref()?.get(&(f as usize)).copied()
}

/// The fork prepare handler's part: see `shim::process::before_fork` (the fixed order of the locks).
pub fn lock_for_fork() {
    STREAMS.lock_raw();
}

/// Releases what [`lock_for_fork`] took (the parent, or the child, after fork).
///
/// # Safety
/// Only after [`lock_for_fork`] on this thread.
pub unsafe fn unlock_after_fork() {
    STREAMS.unlock_raw();
}

/// In a fork child whose fork did not take the lock (a fork from a signal handler inside the
/// shim): an empty table (`fileno` of an older stream then answers glibc's -1).
///
/// # Safety
/// Only in the fork child handler.
pub unsafe fn reset_in_child() {
    STREAMS.reset_in_child(None);
    COUNT.store(0, Ordering::Relaxed);
}

/// `open` flags of an `fopen` mode, and whether it writes.
fn mode_flags(mode: &[u8]) -> Option<(c_int, bool)> {
    let (mut flags, writes) = match mode.first()? {
        b'r' => (libc::O_RDONLY, false),
        b'w' => (libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC, true),
        b'a' => (libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND, true),
        _ => return None,
    };
    let mut writes = writes;
    for &c in &mode[1..] {
        match c {
            b'+' => {
                flags = (flags & !libc::O_WRONLY) | libc::O_RDWR;
                writes = true;
            }
            b'e' => flags |= libc::O_CLOEXEC,
            b'x' => flags |= libc::O_EXCL,
            b',' => break, // ",ccs=..." (wide-character encodings): not ours to interpret
            _ => {}
        }
    }
    Some((flags, writes))
}

unsafe extern "C" fn cookie_read(c: *mut c_void, buf: *mut c_char, n: size_t) -> ssize_t {
    // SAFETY: the cookie is the boxed fd made in `wrap`.
    libc::read(*(c as *const c_int), buf as *mut c_void, n)
}

unsafe extern "C" fn cookie_write(c: *mut c_void, buf: *const c_char, n: size_t) -> ssize_t {
    // SAFETY: as above; the shim replicates (or fails loudly) like a direct write(2).
    crate::shim::write(*(c as *const c_int), buf as *const c_void, n, None)
}

unsafe extern "C" fn cookie_seek(c: *mut c_void, off: *mut off64_t, whence: c_int) -> c_int {
    // SAFETY: as above; `off` is glibc's in/out position.
    let r = libc::lseek64(*(c as *const c_int), *off, whence);
    if r < 0 {
        return -1;
    }
    *off = r;
    0
}

unsafe extern "C" fn cookie_close(c: *mut c_void) -> c_int {
    // SAFETY: the box made in `wrap`, freed once (glibc calls close once per stream).
    let fd = *Box::from_raw(c as *mut c_int);
    // Inside the shim's guard, like every shim lock (see `stream_fd`). From a signal handler
    // that interrupted the shim the entry stays (a stale entry only names a closed fd).
    if let Some(_g) = crate::shim::enter() {
        if let Some(m) = STREAMS.lock().as_mut() {
            let before = m.len();
            m.retain(|_, v| *v != fd);
            COUNT.fetch_sub(before - m.len(), Ordering::Relaxed);
        }
    }
    crate::shim::close(fd)
}

/// A stream over `fd` whose writes go through the shim. On failure the fd is left open.
unsafe fn wrap(fd: c_int, mode: *const c_char) -> *mut FILE {
    // Inside the shim's guard, like every shim lock (see `stream_fd`); from a signal handler
    // that interrupted the shim (an fopen there) the table cannot be updated: EIO.
    let Some(_g) = crate::shim::enter() else {
        *libc::__errno_location() = libc::EIO;
        return std::ptr::null_mut();
    };
    let cookie = Box::into_raw(Box::new(fd)) as *mut c_void;
    let funcs = CookieIoFunctions { read: Some(cookie_read), write: Some(cookie_write), seek: Some(cookie_seek), close: Some(cookie_close) };
    // SAFETY: a valid mode string and cookie; glibc keeps the functions for the stream's life.
    let f = fopencookie(cookie, mode, funcs);
    if f.is_null() {
        drop(Box::from_raw(cookie as *mut c_int));
        return f;
    }
    STREAMS.lock().get_or_insert_with(HashMap::new).insert(f as usize, fd);
    COUNT.fetch_add(1, Ordering::Relaxed);
    f
}

/// What `fopen` should do.
pub enum Open {
    /// Not a log file being written: the real `fopen` (after verifying a log file's local copy).
    Pass,
    /// Fail with errno as set.
    Fail,
    Stream(*mut FILE),
}

pub unsafe fn fopen(path: *const c_char, mode: *const c_char) -> Open {
    if path.is_null() || mode.is_null() {
        return Open::Pass;
    }
    let Some((flags, writes)) = mode_flags(CStr::from_ptr(mode).to_bytes()) else { return Open::Pass };
    if !writes || !crate::shim::is_log_stream_path(path) {
        return match crate::shim::before_read(path, false) {
            Ok(()) => Open::Pass,
            Err(()) => {
                *libc::__errno_location() = libc::EIO;
                Open::Fail
            }
        };
    }
    // The shim's open: recovery, a new epoch, and an fd whose writes replicate.
    let fd = crate::shim::open_at(libc::AT_FDCWD, path, flags, 0o666);
    if fd < 0 {
        return Open::Fail;
    }
    let f = wrap(fd, mode);
    if f.is_null() {
        let e = *libc::__errno_location();
        crate::shim::close(fd);
        *libc::__errno_location() = e;
        return Open::Fail;
    }
    Open::Stream(f)
}

/// `fdopen` of a log fd: a stream through the shim (None: not a log fd, use the real one).
pub unsafe fn fdopen(fd: c_int, mode: *const c_char) -> Option<*mut FILE> {
    if !crate::shim::is_log_fd(fd) || mode.is_null() {
        return None;
    }
    Some(wrap(fd, mode))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes() {
        assert_eq!(mode_flags(b"r"), Some((libc::O_RDONLY, false)));
        assert_eq!(mode_flags(b"rb+"), Some((libc::O_RDWR, true)));
        assert_eq!(mode_flags(b"ae"), Some((libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND | libc::O_CLOEXEC, true)));
        assert_eq!(mode_flags(b"w+x"), Some((libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC | libc::O_EXCL, true)));
        assert_eq!(mode_flags(b"q"), None);
    }
}
