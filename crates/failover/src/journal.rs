//! Durable record of the monitor's state: one JSON file replaced atomically (write a temporary
//! file, fsync it, rename, fsync the directory) after every step and before its actions run.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::proto::{Durable, MonitorConfig};

/// What is written: the state plus the configuration it was made under, so a restart with a
/// different spec is noticed.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub config: MonitorConfig,
    pub state: Durable,
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("cannot write the monitor state {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("cannot read the monitor state {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("the monitor state {path} is corrupt ({source}); move it away to start afresh")]
    Corrupt { path: PathBuf, source: serde_json::Error },
}

pub struct FileJournal {
    path: PathBuf,
}

impl FileJournal {
    pub fn new(path: &Path) -> FileJournal {
        FileJournal { path: path.to_path_buf() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn load(&self) -> Result<Option<Record>, JournalError> {
        match std::fs::read(&self.path) {
            Ok(b) => serde_json::from_slice(&b).map(Some).map_err(|source| JournalError::Corrupt { path: self.path.clone(), source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(JournalError::Read { path: self.path.clone(), source }),
        }
    }

    pub fn save(&self, r: &Record) -> Result<(), JournalError> {
        let w = |source| JournalError::Write { path: self.path.clone(), source };
        let tmp = self.path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp).map_err(w)?;
        f.write_all(&serde_json::to_vec_pretty(r).expect("serialisable")).map_err(w)?;
        f.sync_all().map_err(w)?;
        std::fs::rename(&tmp, &self.path).map_err(w)?;
        let dir = self.path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(w)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::Monitor;
    use crate::proto::MonitorConfig;

    #[test]
    fn round_trip_and_corrupt_file() {
        let dir = tempfile::tempdir().unwrap();
        let j = FileJournal::new(&dir.path().join("monitor.json"));
        assert!(j.load().unwrap().is_none());
        let m = Monitor::new(MonitorConfig::default(), "db".into(), 0);
        let r = Record { config: m.config().clone(), state: m.durable().clone() };
        j.save(&r).unwrap();
        assert_eq!(j.load().unwrap(), Some(r));
        std::fs::write(j.path(), b"{not json").unwrap();
        let e = j.load().unwrap_err().to_string();
        assert!(e.contains("corrupt"), "{e}");
    }
}
