//! close, dup/dup2/dup3, fcntl and mmap of a log fd; forgetting fds at close and exit.

use super::*;

pub unsafe fn close(fd: c_int) -> c_int {
    if is_tracked(fd) {
        fd_going(fd);
    }
    (real().close)(fd)
}

/// Log fd `fd` is about to leave this process's fd table (close, or dup2/dup3 over it).
pub(super) fn fd_going(fd: c_int) {
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
pub(super) extern "C" fn at_exit() {
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
pub(super) static AT_EXIT: extern "C" fn() = at_exit;

pub(super) fn forget_fd(fd: c_int) {
    set_tracked(fd, false);
    let mut slot = lock_state();
    if let Some(shim) = slot.as_mut() {
        forget_locked(shim, fd);
    }
}

/// [`forget_fd`]'s work, with the state locked.
pub(super) fn forget_locked(shim: &mut Shim, fd: c_int) {
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
pub(super) fn track_copy(old: c_int, new: c_int) -> c_int {
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

pub(super) type FcntlFn = unsafe extern "C" fn(c_int, c_int, ...) -> c_int;
pub(super) type Dup2Fn = unsafe extern "C" fn(c_int, c_int) -> c_int;
pub(super) type Dup3Fn = unsafe extern "C" fn(c_int, c_int, c_int) -> c_int;

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
