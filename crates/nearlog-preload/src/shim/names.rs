//! rename and unlink of log files (the controller and the peers are told).

use super::*;

/// Tells the peers of a forgotten file to free its memory (best effort: a peer that misses it
/// holds bytes of a file nobody will open again until it restarts).
pub(super) fn drop_on_peers(shim: &mut Shim, g: &FileGrant) {
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
pub(super) fn forget(from: &str, to: Option<&str>) {
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
