//! Directory listing: `opendir` of a directory recovers the replicated log files it lacks.

use super::*;

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
pub(super) const MAX_LISTED_DIRS: usize = 1024;
pub(super) static LISTED: ForkLock<Vec<String>> = ForkLock::new(Vec::new());
