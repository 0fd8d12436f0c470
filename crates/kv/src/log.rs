//! The emulated persistent-memory log (§V-B): one append-only file of records, each
//! `len: u32 LE | crc32c: u32 LE | postcard(LogRecord)`. A `Put` is an update reaching its local
//! durability point; a `Mark` sets the entry's GDP flag (the update is known committed /
//! globally durable) — written lazily, since a lost flag only puts the entry on the
//! Partially_persisted list, where the Buddy resolves it. Reading stops at the first torn or
//! corrupt record: everything after it was never acknowledged as durable.
//!
//! [`PmLog`] is the storage interface; [`FileLog`] the runtime implementation (a file opened
//! with `O_DSYNC`, an optional extra latency per persist to model slower NVM). The simulation
//! tests implement it over `sim::SimDisk`.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::msg::Ts;

/// Largest record accepted when reading a log back (a maximal key and value plus framing).
pub const MAX_RECORD_BYTES: usize = crate::msg::MAX_VALUE_BYTES + crate::msg::MAX_KEY_BYTES + 64;

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LogRecord {
    /// Written (and synced) once, when the node first joins its group: a log with `Boot` belongs
    /// to a node that was a member before and must recover before it serves again.
    Boot { node: u32 },
    Put { key: Vec<u8>, ts: Ts, value: Vec<u8> },
    Mark { key: Vec<u8>, ts: Ts },
}

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("log I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("log record encoding failed: {0}")]
    Encode(String),
}

/// Encodes one record with its header.
pub fn encode(rec: &LogRecord) -> Vec<u8> {
    let payload = postcard::to_allocvec(rec).expect("log records always encode");
    let mut out = Vec::with_capacity(payload.len() + 8);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

/// Decodes records from a whole log image, stopping at the first incomplete or corrupt one.
/// Returns the records and the byte length of the valid prefix.
pub fn decode_all(bytes: &[u8]) -> (Vec<LogRecord>, usize) {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos + 8 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(bytes[pos + 4..pos + 8].try_into().unwrap());
        if len > MAX_RECORD_BYTES || pos + 8 + len > bytes.len() {
            break;
        }
        let payload = &bytes[pos + 8..pos + 8 + len];
        if crc32c::crc32c(payload) != crc {
            break;
        }
        match postcard::from_bytes::<LogRecord>(payload) {
            Ok(r) => out.push(r),
            Err(_) => break,
        }
        pos += 8 + len;
    }
    (out, pos)
}

/// What a node finds in its log when it starts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogState {
    /// The node was a member before (see [`LogRecord::Boot`]).
    pub booted: bool,
    /// Per key, the newest entry with its GDP flag set: known committed.
    pub base: BTreeMap<Vec<u8>, (Ts, Vec<u8>)>,
    /// The Partially_persisted list: per key, the newest persisted entry newer than `base` whose
    /// flag is clear.
    pub partially: BTreeMap<Vec<u8>, (Ts, Vec<u8>)>,
    pub records: usize,
}

/// Replays records into a [`LogState`].
pub fn rebuild(records: &[LogRecord]) -> LogState {
    let mut puts: BTreeMap<Vec<u8>, BTreeMap<Ts, (Vec<u8>, bool)>> = BTreeMap::new();
    let mut booted = false;
    for r in records {
        match r {
            LogRecord::Boot { .. } => booted = true,
            LogRecord::Put { key, ts, value } => {
                let e = puts.entry(key.clone()).or_default().entry(*ts).or_insert((Vec::new(), false));
                e.0 = value.clone();
            }
            LogRecord::Mark { key, ts } => {
                // A mark may precede its put in the file only if the put was never made
                // durable; such a mark refers to nothing.
                if let Some(e) = puts.get_mut(key).and_then(|m| m.get_mut(ts)) {
                    e.1 = true;
                }
            }
        }
    }
    let mut st = LogState {
        booted,
        records: records.len(),
        ..Default::default()
    };
    for (key, versions) in puts {
        let base = versions.iter().rev().find(|(_, (_, marked))| *marked);
        if let Some((ts, (v, _))) = base {
            st.base.insert(key.clone(), (*ts, v.clone()));
        }
        let base_ts = base.map(|(t, _)| *t).unwrap_or_default();
        if let Some((ts, (v, marked))) = versions.iter().next_back() {
            if !*marked && *ts > base_ts {
                st.partially.insert(key, (*ts, v.clone()));
            }
        }
    }
    st
}

/// Durable storage of a node's log.
pub trait PmLog {
    /// Appends records and makes them durable before returning.
    fn append_durable(&mut self, recs: &[LogRecord]) -> Result<(), LogError>;
    /// Appends records without waiting for durability (GDP flags).
    fn append_lazy(&mut self, recs: &[LogRecord]) -> Result<(), LogError>;
    /// Every record that survived.
    fn read_all(&mut self) -> Result<Vec<LogRecord>, LogError>;
}

/// The runtime log: an `O_DSYNC` file, so each append returns once it is on stable storage.
/// `extra_persist_latency` is added to every durable append to model NVM slower than the disk
/// cache (zero by default).
pub struct FileLog {
    file: File,
    dsync: File,
    extra_persist_latency: Duration,
}

impl FileLog {
    pub fn open(path: &Path, extra_persist_latency: Duration) -> Result<Self, LogError> {
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)?;
        let dsync = OpenOptions::new()
            .append(true)
            .custom_flags(libc::O_DSYNC)
            .open(path)?;
        let mut me = FileLog {
            file,
            dsync,
            extra_persist_latency,
        };
        // Cut a torn tail so new records follow the valid prefix.
        let mut bytes = Vec::new();
        me.file.read_to_end(&mut bytes)?;
        let (_, valid) = decode_all(&bytes);
        if valid < bytes.len() {
            me.file.set_len(valid as u64)?;
            me.file.sync_data()?;
        }
        Ok(me)
    }
}

impl PmLog for FileLog {
    fn append_durable(&mut self, recs: &[LogRecord]) -> Result<(), LogError> {
        let mut buf = Vec::new();
        for r in recs {
            buf.extend_from_slice(&encode(r));
        }
        self.dsync.write_all(&buf)?;
        if !self.extra_persist_latency.is_zero() {
            std::thread::sleep(self.extra_persist_latency);
        }
        Ok(())
    }

    fn append_lazy(&mut self, recs: &[LogRecord]) -> Result<(), LogError> {
        let mut buf = Vec::new();
        for r in recs {
            buf.extend_from_slice(&encode(r));
        }
        self.file.write_all(&buf)?;
        Ok(())
    }

    fn read_all(&mut self) -> Result<Vec<LogRecord>, LogError> {
        use std::io::Seek;
        self.file.seek(std::io::SeekFrom::Start(0))?;
        let mut bytes = Vec::new();
        self.file.read_to_end(&mut bytes)?;
        Ok(decode_all(&bytes).0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(v: u64, n: u32) -> Ts {
        Ts { version: v, node: n }
    }

    #[test]
    fn rebuild_takes_marked_base_and_partially() {
        let k = b"k".to_vec();
        let recs = vec![
            LogRecord::Boot { node: 0 },
            LogRecord::Put { key: k.clone(), ts: ts(1, 0), value: b"a".to_vec() },
            LogRecord::Mark { key: k.clone(), ts: ts(1, 0) },
            LogRecord::Put { key: k.clone(), ts: ts(2, 1), value: b"b".to_vec() },
        ];
        let st = rebuild(&recs);
        assert!(st.booted);
        assert_eq!(st.base[&k], (ts(1, 0), b"a".to_vec()));
        assert_eq!(st.partially[&k], (ts(2, 1), b"b".to_vec()));
    }

    #[test]
    fn decode_stops_at_torn_tail() {
        let mut bytes = encode(&LogRecord::Boot { node: 3 });
        let second = encode(&LogRecord::Mark { key: b"x".to_vec(), ts: ts(1, 1) });
        bytes.extend_from_slice(&second[..second.len() - 1]);
        let (recs, valid) = decode_all(&bytes);
        assert_eq!(recs.len(), 1);
        assert_eq!(valid, encode(&LogRecord::Boot { node: 3 }).len());
    }

    #[test]
    fn file_log_round_trip_and_torn_tail_cut() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("log");
        {
            let mut l = FileLog::open(&p, Duration::ZERO).unwrap();
            l.append_durable(&[LogRecord::Boot { node: 1 }]).unwrap();
            l.append_lazy(&[LogRecord::Mark { key: b"a".to_vec(), ts: ts(1, 1) }]).unwrap();
        }
        std::fs::OpenOptions::new().append(true).open(&p).unwrap().write_all(&[9, 9, 9]).unwrap();
        let mut l = FileLog::open(&p, Duration::ZERO).unwrap();
        assert_eq!(l.read_all().unwrap().len(), 2);
        l.append_durable(&[LogRecord::Boot { node: 1 }]).unwrap();
        assert_eq!(l.read_all().unwrap().len(), 3);
    }
}
