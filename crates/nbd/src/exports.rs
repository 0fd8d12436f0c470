//! How the server finds the device behind an export name.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use blockdev::BlockDev;

/// The set of exports a server offers. `open` is called once per connection that selects an
/// export (NBD_OPT_GO / NBD_OPT_EXPORT_NAME) and once per NBD_OPT_INFO.
pub trait Exports: Send + Sync + 'static {
    type Dev: BlockDev;
    /// Returns the device named `name`, or a message saying why there is none (sent to the
    /// client with NBD_REP_ERR_UNKNOWN).
    fn open(&self, name: &str) -> impl Future<Output = Result<Arc<Self::Dev>, String>> + Send;
    /// Names listed in reply to NBD_OPT_LIST.
    fn list(&self) -> impl Future<Output = Vec<String>> + Send;
}

/// One device under one name. The empty name (what `nbd://host:port` asks for) is the default
/// export and also selects it.
pub struct SingleExport<D> {
    name: String,
    dev: Arc<D>,
}

impl<D: BlockDev> SingleExport<D> {
    pub fn new(name: impl Into<String>, dev: Arc<D>) -> Self {
        SingleExport {
            name: name.into(),
            dev,
        }
    }
}

impl<D: BlockDev> Exports for SingleExport<D> {
    type Dev = D;
    async fn open(&self, name: &str) -> Result<Arc<D>, String> {
        if name == self.name || name.is_empty() {
            Ok(self.dev.clone())
        } else {
            Err(format!(
                "no export named {name:?}; this server exports {:?}",
                self.name
            ))
        }
    }
    async fn list(&self) -> Vec<String> {
        vec![self.name.clone()]
    }
}

/// Several devices of one type, by name (exact match only).
pub struct MapExports<D> {
    devs: BTreeMap<String, Arc<D>>,
}

impl<D: BlockDev> MapExports<D> {
    pub fn new() -> Self {
        MapExports {
            devs: BTreeMap::new(),
        }
    }
    /// Adds (or replaces) an export.
    pub fn with(mut self, name: impl Into<String>, dev: Arc<D>) -> Self {
        self.devs.insert(name.into(), dev);
        self
    }
}

impl<D: BlockDev> Default for MapExports<D> {
    fn default() -> Self {
        Self::new()
    }
}

impl<D: BlockDev> Exports for MapExports<D> {
    type Dev = D;
    async fn open(&self, name: &str) -> Result<Arc<D>, String> {
        self.devs.get(name).cloned().ok_or_else(|| {
            format!(
                "no export named {name:?}; known: {:?}",
                self.devs.keys().collect::<Vec<_>>()
            )
        })
    }
    async fn list(&self) -> Vec<String> {
        self.devs.keys().cloned().collect()
    }
}
