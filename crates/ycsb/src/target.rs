//! The interface a store implements to be measured.

use std::future::Future;

/// Records a scan returns: `(key, value)` in key order.
pub type Records = Vec<(Vec<u8>, Vec<u8>)>;

/// Why an operation on a target failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    /// The target cannot do this at all (e.g. scans on a store without ordered keys); the run
    /// stops at the first one, as every later one would fail too.
    #[error("{operation} is not supported by {target}: {hint}")]
    Unsupported {
        operation: &'static str,
        target: &'static str,
        hint: &'static str,
    },
    /// The connection failed (refused, reset, timed out); the target may reconnect.
    #[error("connection: {0}")]
    Io(String),
    /// The store answered with an error or something the client cannot parse.
    #[error("store: {0}")]
    Store(String),
}

/// One client's connection to a key-value store.
///
/// Each closed-loop client of the [`crate::Runner`] owns one target and has one operation in
/// flight at a time, so a target need not be shareable; a store whose client multiplexes
/// can hand out cheap clones. Keys and values are bytes; values are whole records.
pub trait KvTarget: Send + 'static {
    /// A short name for reports and errors, e.g. `"redis"`.
    fn name(&self) -> &'static str;

    /// The value of `key`, or `None` if it has none.
    fn get(
        &mut self,
        key: &[u8],
    ) -> impl Future<Output = Result<Option<Vec<u8>>, TargetError>> + Send;

    /// Sets `key` to `value` (a YCSB update: the record exists).
    fn put(
        &mut self,
        key: &[u8],
        value: &[u8],
    ) -> impl Future<Output = Result<(), TargetError>> + Send;

    /// Adds a new record (the load phase and YCSB inserts). By default a [`KvTarget::put`];
    /// a store that keeps an index for scans overrides it.
    fn insert(
        &mut self,
        key: &[u8],
        value: &[u8],
    ) -> impl Future<Output = Result<(), TargetError>> + Send {
        self.put(key, value)
    }

    /// Up to `count` records in key order starting at `start` (inclusive). Unsupported unless
    /// the store overrides it.
    fn scan(
        &mut self,
        _start: &[u8],
        _count: usize,
    ) -> impl Future<Output = Result<Records, TargetError>> + Send {
        let target = self.name();
        async move {
            Err(TargetError::Unsupported {
                operation: "scan",
                target,
                hint: "the store keeps no key order; use a workload without scans",
            })
        }
    }

    /// Reads `key`, then writes `new_value(old)` to it, returning the old value. By default a
    /// get followed by a put, as YCSB's read-modify-write is (not atomic).
    fn read_modify_write<F>(
        &mut self,
        key: &[u8],
        new_value: F,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, TargetError>> + Send
    where
        F: FnOnce(Option<&[u8]>) -> Vec<u8> + Send,
    {
        async move {
            let old = self.get(key).await?;
            let value = new_value(old.as_deref());
            self.put(key, &value).await?;
            Ok(old)
        }
    }
}
