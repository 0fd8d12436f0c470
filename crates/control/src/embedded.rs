//! The embedded backend: one file per key under `DIR/keys/`, for one process at a time.
//!
//! Layout: `DIR/lock` (held with `flock` by the one process using the directory), `DIR/revision`
//! (the store revision, written before a delete, so a revision is never handed out twice, not even
//! to a key deleted and written again; a written key's file holds its own revision, and at open
//! the store's revision is the highest of the two), `DIR/keys/<key with '/' as '+'>` (the key's
//! [`KeyValue`] in postcard with a CRC32C), and `DIR/txn.pending` while a transaction that changes
//! several keys is being applied (replayed at open, so such a transaction is all or nothing).
//! Every file is written to a temporary name, fsynced, renamed and its directory fsynced.
//!
//! Leases are in memory (see the crate doc): a lease expires when not kept alive for its TTL,
//! checked at every operation; keys under a lease found at open belong to a process that is gone
//! and are deleted.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::{Compare, Error, KeyValue, LeaseId, Op, Result, TxnOutcome};

const PENDING: &str = "txn.pending";
const REVISION: &str = "revision";
const TMP_PREFIX: &str = ".tmp-";

pub(crate) struct Embedded {
    dir: PathBuf,
    inner: Mutex<Inner>,
    /// Held for the life of the store: the `flock` is released when it closes.
    _lock: File,
}

struct Inner {
    keys: BTreeMap<String, KeyValue>,
    revision: i64,
    leases: HashMap<LeaseId, Lease>,
    next_lease: LeaseId,
}

struct Lease {
    ttl: Duration,
    expires: Instant,
}

/// A multi-key change, recorded before it is applied.
#[derive(Serialize, Deserialize)]
struct Intent {
    revision: i64,
    changes: Vec<(String, Option<KeyValue>)>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.display().to_string(), source }
}

fn file_name(key: &str) -> String {
    // Keys hold no '+' (checked by `check_key`), so this is one to one.
    key.replace('/', "+")
}

fn key_of(name: &str) -> String {
    name.replace('+', "/")
}

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    let mut bytes = postcard::to_allocvec(v).expect("postcard encodes plain structs");
    let crc = crc32c::crc32c(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    bytes
}

fn decode<T: for<'a> Deserialize<'a>>(path: &Path, bytes: &[u8]) -> Result<T> {
    let corrupt = |why: String| Error::Corrupt { path: path.display().to_string(), why };
    if bytes.len() < 4 {
        return Err(corrupt(format!("{} bytes, shorter than its checksum", bytes.len())));
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if crc32c::crc32c(body).to_le_bytes() != crc {
        return Err(corrupt("checksum mismatch".into()));
    }
    postcard::from_bytes(body).map_err(|e| corrupt(e.to_string()))
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir))
}

/// Writes `bytes` to `path` so that a crash leaves either the old file or the new one.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().expect("store files live in a directory");
    let tmp = dir.join(format!("{TMP_PREFIX}{}", path.file_name().unwrap().to_string_lossy()));
    let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
    f.write_all(bytes).and_then(|_| f.sync_all()).map_err(io_err(&tmp))?;
    fs::rename(&tmp, path).map_err(io_err(path))?;
    fsync_dir(dir)
}

fn remove_durably(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => fsync_dir(path.parent().unwrap()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(path)(e)),
    }
}

impl Embedded {
    pub(crate) fn open(dir: &Path) -> Result<Embedded> {
        let keys_dir = dir.join("keys");
        fs::create_dir_all(&keys_dir).map_err(io_err(&keys_dir))?;
        let lock_path = dir.join("lock");
        let lock = OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path).map_err(io_err(&lock_path))?;
        // SAFETY: flock(2) on a descriptor we own; no memory is shared with the kernel.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(Error::Locked { dir: dir.display().to_string() });
            }
            return Err(io_err(&lock_path)(e));
        }
        let store = Embedded {
            dir: dir.to_path_buf(),
            inner: Mutex::new(Inner { keys: BTreeMap::new(), revision: 0, leases: HashMap::new(), next_lease: 1 }),
            _lock: lock,
        };
        store.recover()?;
        Ok(store)
    }

    fn recover(&self) -> Result<()> {
        let mut inner = self.inner.lock().unwrap();
        for d in [self.dir.clone(), self.dir.join("keys")] {
            for entry in fs::read_dir(&d).map_err(io_err(&d))? {
                let entry = entry.map_err(io_err(&d))?;
                if entry.file_name().to_string_lossy().starts_with(TMP_PREFIX) {
                    let _ = fs::remove_file(entry.path());
                }
            }
        }
        let rev_path = self.dir.join(REVISION);
        if let Ok(bytes) = fs::read(&rev_path) {
            inner.revision = decode(&rev_path, &bytes)?;
        }
        let pending = self.dir.join(PENDING);
        if let Ok(bytes) = fs::read(&pending) {
            let intent: Intent = decode(&pending, &bytes)?;
            self.write_changes(&intent.changes)?;
            inner.revision = inner.revision.max(intent.revision);
            remove_durably(&pending)?;
        }
        let keys_dir = self.dir.join("keys");
        for entry in fs::read_dir(&keys_dir).map_err(io_err(&keys_dir))? {
            let entry = entry.map_err(io_err(&keys_dir))?;
            let path = entry.path();
            let bytes = fs::read(&path).map_err(io_err(&path))?;
            let kv: KeyValue = decode(&path, &bytes)?;
            if kv.key != key_of(&entry.file_name().to_string_lossy()) {
                return Err(Error::Corrupt { path: path.display().to_string(), why: format!("holds key {}", kv.key) });
            }
            inner.revision = inner.revision.max(kv.mod_revision);
            inner.keys.insert(kv.key.clone(), kv);
        }
        // Leases died with the process that held them: so do their keys.
        let orphans: Vec<(String, Option<KeyValue>)> = inner.keys.values().filter(|kv| kv.lease != 0).map(|kv| (kv.key.clone(), None)).collect();
        if !orphans.is_empty() {
            let rev = inner.revision + 1;
            self.apply(&mut inner, orphans, rev)?;
        }
        inner.next_lease = rand::random::<u32>() as i64 + 1;
        Ok(())
    }

    fn write_changes(&self, changes: &[(String, Option<KeyValue>)]) -> Result<()> {
        for (key, kv) in changes {
            let path = self.dir.join("keys").join(file_name(key));
            match kv {
                Some(kv) => write_atomic(&path, &encode(kv))?,
                None => remove_durably(&path)?,
            }
        }
        Ok(())
    }

    /// Makes `changes` durable at `revision`, then visible.
    fn apply(&self, inner: &mut Inner, changes: Vec<(String, Option<KeyValue>)>, revision: i64) -> Result<()> {
        let pending = self.dir.join(PENDING);
        let several = changes.len() > 1;
        let intent = Intent { revision, changes };
        if several {
            write_atomic(&pending, &encode(&intent))?;
        }
        // A written key records its revision in its own file; only a delete can take the
        // highest revision off the disk, so only then is the counter written (a write costs two
        // fsyncs, not four).
        if intent.changes.iter().any(|(_, kv)| kv.is_none()) {
            write_atomic(&self.dir.join(REVISION), &encode(&revision))?;
        }
        self.write_changes(&intent.changes)?;
        if several {
            remove_durably(&pending)?;
        }
        inner.revision = revision;
        for (key, kv) in intent.changes {
            match kv {
                Some(kv) => inner.keys.insert(key, kv),
                None => inner.keys.remove(&key),
            };
        }
        Ok(())
    }

    /// Ends the leases not kept alive, deleting their keys.
    fn expire(&self, inner: &mut Inner, now: Instant) -> Result<()> {
        let dead: Vec<LeaseId> = inner.leases.iter().filter(|(_, l)| l.expires <= now).map(|(id, _)| *id).collect();
        if dead.is_empty() {
            return Ok(());
        }
        for id in &dead {
            inner.leases.remove(id);
        }
        self.drop_keys_of(inner, &dead)
    }

    fn drop_keys_of(&self, inner: &mut Inner, leases: &[LeaseId]) -> Result<()> {
        let changes: Vec<(String, Option<KeyValue>)> = inner.keys.values().filter(|kv| leases.contains(&kv.lease)).map(|kv| (kv.key.clone(), None)).collect();
        if changes.is_empty() {
            return Ok(());
        }
        let rev = inner.revision + 1;
        self.apply(inner, changes, rev)
    }

    fn locked(&self) -> Result<std::sync::MutexGuard<'_, Inner>> {
        let mut inner = self.inner.lock().unwrap();
        self.expire(&mut inner, Instant::now())?;
        Ok(inner)
    }

    pub(crate) fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        Ok(self.locked()?.keys.get(key).cloned())
    }

    pub(crate) fn list(&self, prefix: &str) -> Result<Vec<KeyValue>> {
        let inner = self.locked()?;
        Ok(inner.keys.range(prefix.to_string()..).take_while(|(k, _)| k.starts_with(prefix)).map(|(_, kv)| kv.clone()).collect())
    }

    pub(crate) fn txn(&self, compares: &[Compare], then: &[Op], on_failure_get: Option<&str>) -> Result<TxnOutcome> {
        let mut inner = self.locked()?;
        if !compares.iter().all(|c| c.holds(inner.keys.get(&c.key))) {
            let failure_read = on_failure_get.and_then(|k| inner.keys.get(k).cloned());
            return Ok(TxnOutcome { succeeded: false, revision: inner.revision, failure_read });
        }
        let rev = inner.revision + 1;
        let mut changes: Vec<(String, Option<KeyValue>)> = Vec::new();
        for op in then {
            let key = match op {
                Op::Put { key, .. } | Op::Delete { key } => key,
            };
            if changes.iter().any(|(k, _)| k == key) {
                return Err(Error::BadKey { key: key.clone(), why: "written twice in one transaction (etcd refuses that too)" });
            }
            match op {
                Op::Put { key, value, lease } => {
                    if *lease != 0 && !inner.leases.contains_key(lease) {
                        return Err(Error::LeaseExpired(*lease));
                    }
                    let old = inner.keys.get(key);
                    let kv = KeyValue {
                        key: key.clone(),
                        value: value.clone(),
                        create_revision: old.map_or(rev, |o| o.create_revision),
                        mod_revision: rev,
                        version: old.map_or(1, |o| o.version + 1),
                        lease: *lease,
                    };
                    changes.push((key.clone(), Some(kv)));
                }
                Op::Delete { key } => {
                    if inner.keys.contains_key(key) {
                        changes.push((key.clone(), None));
                    }
                }
            }
        }
        // As on etcd, a transaction that changes nothing does not move the revision.
        if !changes.is_empty() {
            self.apply(&mut inner, changes, rev)?;
        }
        Ok(TxnOutcome { succeeded: true, revision: inner.revision, failure_read: None })
    }

    pub(crate) fn lease_grant(&self, ttl_secs: i64) -> Result<LeaseId> {
        let mut inner = self.locked()?;
        let id = inner.next_lease;
        inner.next_lease += 1;
        let ttl = Duration::from_secs(ttl_secs as u64);
        inner.leases.insert(id, Lease { ttl, expires: Instant::now() + ttl });
        Ok(id)
    }

    pub(crate) fn lease_keepalive(&self, id: LeaseId) -> Result<()> {
        let mut inner = self.locked()?;
        match inner.leases.get_mut(&id) {
            Some(l) => {
                l.expires = Instant::now() + l.ttl;
                Ok(())
            }
            None => Err(Error::LeaseExpired(id)),
        }
    }

    pub(crate) fn lease_revoke(&self, id: LeaseId) -> Result<()> {
        let mut inner = self.locked()?;
        if inner.leases.remove(&id).is_none() {
            return Err(Error::LeaseExpired(id));
        }
        self.drop_keys_of(&mut inner, &[id])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: &str, value: &[u8], rev: i64) -> KeyValue {
        KeyValue { key: key.into(), value: value.to_vec(), create_revision: rev, mod_revision: rev, version: 1, lease: 0 }
    }

    /// A crash after a multi-key transaction's intent was written and before all its keys were:
    /// the next open applies all of it.
    #[test]
    fn a_pending_transaction_is_replayed_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let store = Embedded::open(dir.path()).unwrap();
        store.txn(&[], &[Op::put("/a", b"old".to_vec()), Op::put("/b", b"old".to_vec())], None).unwrap();
        drop(store);
        let intent = Intent { revision: 9, changes: vec![("/a".into(), Some(kv("/a", b"new", 9))), ("/b".into(), None), ("/c".into(), Some(kv("/c", b"new", 9)))] };
        write_atomic(&dir.path().join(PENDING), &encode(&intent)).unwrap();
        // Only the first change had reached its file.
        write_atomic(&dir.path().join("keys").join(file_name("/a")), &encode(&kv("/a", b"new", 9))).unwrap();

        let store = Embedded::open(dir.path()).unwrap();
        assert_eq!(store.get("/a").unwrap().unwrap().value, b"new");
        assert_eq!(store.get("/b").unwrap(), None);
        assert_eq!(store.get("/c").unwrap().unwrap().value, b"new");
        assert!(!dir.path().join(PENDING).exists());
        let next = store.txn(&[], &[Op::put("/d", b"x".to_vec())], None).unwrap().revision;
        assert_eq!(next, 10, "revisions continue after the replayed transaction");
    }
}
