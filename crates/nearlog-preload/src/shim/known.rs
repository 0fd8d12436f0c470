//! Local copies known to be current (remembered per process and on tmpfs per boot, bounded).

use super::*;

/// Local copies this process made current for reading: key, file id, the state their content
/// is, and the file's identity and change times right after ([`verify_local_copy`]).
pub(super) type KnownCopy = (String, nearlog::proto::FileId, nearlog::proto::Holding, [i64; 6]);
pub(super) static KNOWN_COPIES: ForkLock<Vec<KnownCopy>> = ForkLock::new(Vec::new());
/// Longest [`remember_copy`] waits for the file-time clock to tick past the copy's change time.
pub(super) const MAX_TICK_WAIT_MS: u32 = 20;
/// Copies [`KNOWN_COPIES`] remembers (oldest forgotten first: it only saves a re-check).
pub(super) const MAX_KNOWN_COPIES: usize = 64;

/// What must be unchanged for a remembered copy to still be that state: any write to the
/// file (through the shim or not), a truncate or a replacement changes one of these.
pub(super) fn identity(st: &libc::stat64) -> [i64; 6] {
    [st.st_dev as i64, st.st_ino as i64, st.st_size, st.st_mtime, st.st_mtime_nsec, st.st_ctime_nsec]
}

pub(super) fn known_copy(key: &str, file: nearlog::proto::FileId, st: &libc::stat64) -> Option<nearlog::proto::Holding> {
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
pub(super) fn known_dir() -> Option<&'static str> {
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

pub(super) fn known_path(key: &str) -> Option<String> {
    // FNV-1a of the key names the record; the record holds the key (a collision is a miss).
    let h = key.bytes().fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3));
    Some(format!("{}/{h:016x}", known_dir()?))
}

pub(super) fn known_on_this_boot(key: &str) -> Option<KnownCopy> {
    let text = std::fs::read_to_string(known_path(key)?).ok()?;
    let (k, rest) = text.split_once('\n')?;
    let n: Vec<u64> = rest.split_whitespace().map(|v| v.parse::<i64>().map(|v| v as u64)).collect::<Result<_, _>>().ok()?;
    let [file, epoch, seq, size, i0, i1, i2, i3, i4, i5] = n[..] else { return None };
    let id = [i0 as i64, i1 as i64, i2 as i64, i3 as i64, i4 as i64, i5 as i64];
    Some((k.to_string(), file, nearlog::proto::Holding { epoch, seq, size }, id))
}

/// Default of `UNDERSTUDY_NEARLOG_KNOWN_MAX_RECORDS`: records kept on tmpfs (each names one log
/// file; the oldest are removed first — a missing record only costs a re-check of its copy).
pub(super) const DEFAULT_KNOWN_MAX_RECORDS: usize = 1024;
/// Default of `UNDERSTUDY_NEARLOG_KNOWN_MAX_BYTES`: bytes of tmpfs (memory) the records may take.
pub(super) const DEFAULT_KNOWN_MAX_BYTES: u64 = 1 << 20;

/// The bounds on tmpfs records: (count, bytes), from the environment (read once).
pub(super) fn known_bounds() -> (usize, u64) {
    static B: OnceLock<(usize, u64)> = OnceLock::new();
    *B.get_or_init(|| {
        let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
        (env("UNDERSTUDY_NEARLOG_KNOWN_MAX_RECORDS").map_or(DEFAULT_KNOWN_MAX_RECORDS, |n| n as usize), env("UNDERSTUDY_NEARLOG_KNOWN_MAX_BYTES").unwrap_or(DEFAULT_KNOWN_MAX_BYTES))
    })
}

/// Removes the oldest records until one of `incoming` bytes fits the bounds beside the rest
/// (keys are many when an application names its logs by number: they must not pile up in
/// memory until a reboot). False if it cannot fit at all.
pub(super) fn make_room_for_record(dir: &str, keep: &str, incoming: u64, (max_records, max_bytes): (usize, u64)) -> bool {
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

pub(super) fn remember_on_this_boot(c: &KnownCopy) {
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

pub(super) fn remember_copy(key: &str, file: nearlog::proto::FileId, fd: c_int, state: Option<nearlog::proto::Holding>) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
