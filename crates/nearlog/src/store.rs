//! Where the controller's state lives durably: [`MetaStore`], a local JSON file
//! ([`JsonFileStore`], the default) or memory ([`MemStore`], simulations and tests). The
//! [`crate::core::controller::ControllerCore`] saves through it before it answers.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::proto::ControllerState;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("controller state I/O on {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("controller state file {path} is corrupt: {reason}")]
    Corrupt { path: PathBuf, reason: String },
}

/// Durable home of the controller state (a local JSON file by default; etcd could implement it).
pub trait MetaStore: Send {
    fn load(&mut self) -> Result<Option<ControllerState>, StoreError>;
    fn save(&mut self, state: &ControllerState) -> Result<(), StoreError>;
    /// Whether this controller may answer requests at all: false once a leader's lease has
    /// run out (a controller woken from a pause must not answer even a read from a state a new
    /// leader may have changed). A store of one's own is always true.
    fn may_serve(&self) -> bool {
        true
    }
}

/// `DIR/nearlog-controller.json`, replaced atomically (write temp, fsync, rename, fsync dir).
pub struct JsonFileStore {
    dir: PathBuf,
}

impl JsonFileStore {
    pub fn new(dir: &Path) -> JsonFileStore {
        JsonFileStore { dir: dir.to_path_buf() }
    }
    pub fn path(&self) -> PathBuf {
        self.dir.join("nearlog-controller.json")
    }
}

impl MetaStore for JsonFileStore {
    fn load(&mut self) -> Result<Option<ControllerState>, StoreError> {
        let path = self.path();
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| StoreError::Corrupt { path, reason: e.to_string() }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(StoreError::Io { path, source }),
        }
    }

    fn save(&mut self, state: &ControllerState) -> Result<(), StoreError> {
        let path = self.path();
        let tmp = self.dir.join("nearlog-controller.json.tmp");
        let io = |source| StoreError::Io { path: path.clone(), source };
        let bytes = serde_json::to_vec_pretty(state).expect("state serialises");
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&bytes).map_err(io)?;
        f.sync_all().map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)?;
        std::fs::File::open(&self.dir).and_then(|d| d.sync_all()).map_err(io)?;
        Ok(())
    }
}

/// In-memory store (simulation and tests); `fail_saves` makes every save fail.
#[derive(Default)]
pub struct MemStore {
    pub saved: Option<ControllerState>,
    pub fail_saves: bool,
}

impl MetaStore for MemStore {
    fn load(&mut self) -> Result<Option<ControllerState>, StoreError> {
        Ok(self.saved.clone())
    }
    fn save(&mut self, state: &ControllerState) -> Result<(), StoreError> {
        if self.fail_saves {
            return Err(StoreError::Io { path: "mem".into(), source: std::io::Error::other("injected") });
        }
        self.saved = Some(state.clone());
        Ok(())
    }
}
