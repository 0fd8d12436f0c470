//! An in-memory [`KvTarget`] for testing the runner: an ordered map behind a mutex.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::target::{KvTarget, TargetError};

/// A shared in-memory store; clones share the map. Supports scans (the map is ordered).
/// Not a benchmark target: it measures the mutex, not a store.
#[derive(Clone, Debug, Default)]
pub struct MemTarget {
    map: Arc<Mutex<BTreeMap<Vec<u8>, Vec<u8>>>>,
}

impl MemTarget {
    pub fn new() -> MemTarget {
        MemTarget::default()
    }

    fn map(&self) -> MutexGuard<'_, BTreeMap<Vec<u8>, Vec<u8>>> {
        // Every access is one map operation, so a poisoned lock holds a consistent map.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.map().is_empty()
    }

    /// A copy of the value of `key` (for tests to inspect or to corrupt).
    pub fn value(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.map().get(key).cloned()
    }

    /// Overwrites `key` behind the driver's back (tests use it to plant bad values).
    pub fn set_raw(&self, key: &[u8], value: &[u8]) {
        self.map().insert(key.to_vec(), value.to_vec());
    }

    pub fn remove_raw(&self, key: &[u8]) {
        self.map().remove(key);
    }
}

impl KvTarget for MemTarget {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, TargetError> {
        Ok(self.map().get(key).cloned())
    }

    async fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), TargetError> {
        self.map().insert(key.to_vec(), value.to_vec());
        Ok(())
    }

    async fn scan(&mut self, start: &[u8], count: usize) -> Result<crate::Records, TargetError> {
        Ok(self
            .map()
            .range(start.to_vec()..)
            .take(count)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    async fn read_modify_write<F>(
        &mut self,
        key: &[u8],
        new_value: F,
    ) -> Result<Option<Vec<u8>>, TargetError>
    where
        F: FnOnce(Option<&[u8]>) -> Vec<u8> + Send,
    {
        // Atomic here (one lock), which the trait allows but does not require.
        let mut map = self.map();
        let old = map.get(key).cloned();
        let value = new_value(old.as_deref());
        map.insert(key.to_vec(), value);
        Ok(old)
    }
}
