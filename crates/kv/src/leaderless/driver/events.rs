//! Structured events of a node, for tools rather than people: one JSON object per line on a
//! file the node is told about (`NodeConfig::events`, `understudy kv node --events PATH`).
//! Today one event: a completed recovery, with the breakdown of HEAL Fig. 8 — what the
//! recovery benchmark used to read back out of the human-readable log line.
//!
//! Versioned: every line carries `"v"`; a reader refuses a version it does not know (a changed
//! meaning gets a new version, an added field does not).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::leaderless::core::node::RecoveryStats;
use crate::leaderless::proto::NodeId;

/// The format version written in every line's `"v"`.
pub const EVENTS_VERSION: u32 = 1;

/// Largest event line read back, in bytes (a line is a few hundred bytes; a longer one is not
/// ours).
pub const MAX_EVENT_LINE_BYTES: usize = 64 << 10;

/// One line of the events file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EventLine {
    pub v: u32,
    #[serde(flatten)]
    pub event: Event,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// A recovery completed (HEAL, or a baseline's full copy / reactive log).
    Recovered {
        node: NodeId,
        /// The recovery's latency: start to ack + catch-up to first response + apply to end.
        total_us: u64,
        /// When it ended, in µs since the Unix epoch (the node's wall clock), so a load
        /// generator can place the recovery on its own clock.
        ended_unix_us: u64,
        /// The breakdown, as the core measured it.
        stats: RecoveryStats,
        /// The node's log and catch-up counters since its process started.
        since_start: SinceStart,
    },
}

/// Counters of the node process since it started (see the driver's `NodeStats`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SinceStart {
    pub log_durable_writes: u64,
    pub log_durable_bytes: u64,
    pub log_durable_us: u64,
    pub log_encode_us: u64,
    pub catchup_decode_us: u64,
    pub catchup_queue_us: u64,
    pub catchup_apply_us: u64,
    pub catchup_persisted_us: u64,
    pub recovering_idle_us: u64,
}

/// The writer a node holds: appends one line per event. Without a path it writes nothing.
pub struct EventLog {
    file: Option<(PathBuf, File)>,
}

impl EventLog {
    pub fn open(path: Option<&Path>) -> std::io::Result<Self> {
        let file = match path {
            Some(p) => {
                let f = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| {
                        std::io::Error::new(
                            e.kind(),
                            format!("cannot open the events file {}: {e}", p.display()),
                        )
                    })?;
                Some((p.to_path_buf(), f))
            }
            None => None,
        };
        Ok(EventLog { file })
    }

    /// Appends `event` as one line, in one write (a reader sees whole lines or none). A failure
    /// is reported, not fatal: the events are for tools, the node's service does not depend on
    /// them.
    pub fn append(&mut self, event: Event) {
        let Some((path, f)) = &mut self.file else {
            return;
        };
        let line = EventLine {
            v: EVENTS_VERSION,
            event,
        };
        let mut buf = serde_json::to_vec(&line).expect("an event serialises");
        buf.push(b'\n');
        if let Err(e) = f.write_all(&buf) {
            tracing::warn!("cannot append to the events file {}: {e}", path.display());
        }
    }
}

/// Errors reading an events file back.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    #[error("cannot read the events file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}, byte {at}: not an event line ({what}); is this a node's --events file?")]
    Malformed {
        path: PathBuf,
        at: u64,
        what: String,
    },
    #[error(
        "{path}, byte {at}: events format version {v}, this build reads version {EVENTS_VERSION}"
    )]
    Version { path: PathBuf, at: u64, v: u32 },
}

/// The complete events of the file at `path` from byte `from` on (a line still being written,
/// without its newline, is left for the next read). A missing file has no events yet.
pub fn read_events(path: &Path, from: u64) -> Result<Vec<EventLine>, EventsError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(EventsError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let start = (from as usize).min(bytes.len());
    let tail = &bytes[start..];
    let complete = &tail[..tail.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1)];
    let mut out = Vec::new();
    let mut at = start as u64;
    for line in complete.split_inclusive(|b| *b == b'\n') {
        let malformed = |what: String| EventsError::Malformed {
            path: path.to_path_buf(),
            at,
            what,
        };
        if line.len() > MAX_EVENT_LINE_BYTES {
            return Err(malformed(format!("a line of {} bytes", line.len())));
        }
        // The version first, so a future format is named as such rather than as garbage.
        #[derive(Deserialize)]
        struct Versioned {
            v: u32,
        }
        let v: Versioned = serde_json::from_slice(line).map_err(|e| malformed(e.to_string()))?;
        if v.v != EVENTS_VERSION {
            return Err(EventsError::Version {
                path: path.to_path_buf(),
                at,
                v: v.v,
            });
        }
        out.push(serde_json::from_slice(line).map_err(|e| malformed(e.to_string()))?);
        at += line.len() as u64;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recovered(node: NodeId) -> Event {
        Event::Recovered {
            node,
            total_us: 1500,
            ended_unix_us: 1_700_000_000_000_000,
            stats: RecoveryStats {
                start_to_ack_us: 500,
                catchup_to_resp_us: 400,
                apply_to_end_us: 600,
                entries_received: 7,
                full_copy: true,
                ..Default::default()
            },
            since_start: SinceStart {
                log_durable_bytes: 4096,
                ..Default::default()
            },
        }
    }

    /// Events round-trip through the file; a half-written last line waits for its newline; a
    /// line of another version or of garbage is refused with where it is.
    #[test]
    fn events_round_trip_and_refuse_what_they_do_not_know() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node-1.events");
        assert!(read_events(&path, 0).unwrap().is_empty());
        let mut log = EventLog::open(Some(&path)).unwrap();
        log.append(recovered(1));
        log.append(recovered(2));
        let got = read_events(&path, 0).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].v, EVENTS_VERSION);
        assert_eq!(got[1].event, recovered(2));
        let len = std::fs::metadata(&path).unwrap().len();
        assert!(read_events(&path, len).unwrap().is_empty());

        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"v":1,"event":"recov"#).unwrap();
        assert_eq!(read_events(&path, 0).unwrap().len(), 2);
        f.write_all(b"ered\"}\n").unwrap();
        let e = read_events(&path, len).unwrap_err();
        assert!(
            matches!(e, EventsError::Malformed { at, .. } if at == len),
            "{e}"
        );

        let other = dir.path().join("v2.events");
        std::fs::write(&other, b"{\"v\":2,\"event\":\"something_new\"}\n").unwrap();
        let e = read_events(&other, 0).unwrap_err();
        assert!(matches!(e, EventsError::Version { v: 2, .. }), "{e}");
    }
}
