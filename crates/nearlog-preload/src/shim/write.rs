//! write/pwrite/writev, fsync/fdatasync/sync_file_range and ftruncate of a log fd.

use super::*;

pub(super) fn with_tracked<T>(fd: c_int, f: impl FnOnce(&mut Shim, c_int) -> Result<T, String>, what: &str) -> Result<T, ()> {
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
pub(super) fn replicate(shim: &mut Shim, fd: c_int, offset: u64, data: &[u8]) -> Result<(), String> {
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
pub(super) fn all_acked(c: &FileClient) -> bool {
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
