//! open/openat/creat of a log file, the reads that do not go through our `open` (`fopen` for
//! reading, `stat`), and making a local copy current (recovery, verification).

use super::*;

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
pub(super) const WRITER_LOCK_BYTE: i64 = i64::MAX - 1;

/// Sets (`F_RDLCK`/`F_WRLCK`) or tests (`test`: `F_OFD_GETLK`) the OFD lock on
/// [`WRITER_LOCK_BYTE`]. Ok(false): another open file description holds a conflicting lock.
pub(super) fn writer_lock(fd: c_int, kind: libc::c_short, test: bool) -> std::io::Result<bool> {
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
pub(super) fn sync_local_copy(abs: &str, only_if_missing: bool) -> Result<(), ()> {
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
pub(super) fn verify_local_copy(shim: &mut Shim, fd: c_int, writable: bool, grant: &FileGrant) -> Result<(), String> {
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

pub(super) fn open_log(shim: &mut Shim, fd: c_int, key: &str, flags: c_int) -> Result<(), String> {
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
    lock_as_writer(read_fd, shim.cfg.deadline)?;
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
        make_local_copy_current(shim, fd, key, &grant, &image, local_size)?;
    }
    INHERITED.set(fd, false);
    set_tracked(fd, true);
    Ok(())
}

/// Tells readers on this machine that a writer keeps this local copy current (a read lock on
/// [`WRITER_LOCK_BYTE`] of `read_fd`, released when it closes); waits while a reader repairs
/// the copy, up to `deadline`. On failure `read_fd` is closed.
fn lock_as_writer(read_fd: c_int, deadline: Duration) -> Result<(), String> {
    let until = Instant::now() + deadline;
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
    Ok(())
}

/// After a writer's recovery: the local file is made the recovered image unless it already
/// is (the replicas win over a missing, shorter, longer or different copy).
fn make_local_copy_current(shim: &mut Shim, fd: c_int, key: &str, grant: &FileGrant, image: &[u8], local_size: u64) -> Result<(), String> {
    // Current when recovery took every chunk from the local copy (each checked against the
    // source's block checksums) and the sizes agree; a never-replicated file starts from it.
    let (fetched, _) = shim.files[&fd].client.recovery_bytes();
    let current = shim.files[&fd].client.matched_known() || (image.len() as u64 == local_size && (!grant.initialized || fetched == 0));
    if !current {
        // Missing, shorter, longer (unacknowledged tail) or different: the replicas win.
        write_local_all(fd, image, 0).map_err(|e| format!("restoring the local copy: {e}"))?;
        // SAFETY: real ftruncate on our fd.
        if unsafe { (real().ftruncate)(fd, image.len() as off_t) } != 0 {
            return Err(format!("restoring the local copy: {}", std::io::Error::last_os_error()));
        }
        let (fetched, reused) = shim.files[&fd].client.recovery_bytes();
        log(&format!("recovered {key}: {} bytes from the log peers ({fetched} fetched, {reused} verified from the local copy of {local_size})", image.len()));
    }
    Ok(())
}
