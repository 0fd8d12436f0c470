//! The byte-addressed block device that Understudy's fronts (NBD server, FUSE file) export.
//!
//! A volume client implements [`BlockDev`]; so does [`MemDev`], an in-memory device used to test
//! the fronts without a cluster. Offsets and lengths are bytes; every call may be issued
//! concurrently with others (the fronts keep many I/Os in flight).

use std::future::Future;
use std::sync::Mutex;

/// Why an I/O failed, in the categories a block protocol can report.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DevError {
    /// The range lies (partly) beyond the end of the device.
    #[error("out of range: {0}")]
    OutOfRange(String),
    /// Writes are refused, e.g. the volume was fenced by `collapse`.
    #[error("write refused: {0}")]
    WriteRefused(String),
    /// The storage has no space left.
    #[error("no space: {0}")]
    NoSpace(String),
    /// Any other failure of the storage below.
    #[error("I/O error: {0}")]
    Io(String),
}

pub type DevResult<T> = Result<T, DevError>;

/// A block device with byte-addressed asynchronous I/O.
pub trait BlockDev: Send + Sync + 'static {
    /// Size of the device in bytes.
    fn size_bytes(&self) -> u64;
    /// Reads `len` bytes at `offset`.
    fn read(&self, offset: u64, len: u32) -> impl Future<Output = DevResult<Vec<u8>>> + Send;
    /// Writes `data` at `offset`; durable when it returns.
    fn write(&self, offset: u64, data: Vec<u8>) -> impl Future<Output = DevResult<()>> + Send;
    /// Makes all completed writes durable (they already are for Understudy volumes).
    fn flush(&self) -> impl Future<Output = DevResult<()>> + Send;
    /// Discards a range: later reads return zeroes.
    fn trim(&self, offset: u64, len: u64) -> impl Future<Output = DevResult<()>> + Send;
    /// Writes zeroes over a range.
    fn write_zeroes(&self, offset: u64, len: u64) -> impl Future<Output = DevResult<()>> + Send;
}

/// Checks that `[offset, offset+len)` lies within a device of `size` bytes.
pub fn check_range(size: u64, offset: u64, len: u64) -> DevResult<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(DevError::OutOfRange(format!(
            "offset {offset} + length {len} exceeds device size {size}"
        ))),
    }
}

/// An in-memory block device, for testing fronts.
pub struct MemDev {
    bytes: Mutex<Vec<u8>>,
}

impl MemDev {
    pub fn new(size_bytes: u64) -> Self {
        MemDev { bytes: Mutex::new(vec![0; size_bytes as usize]) }
    }
}

impl BlockDev for MemDev {
    fn size_bytes(&self) -> u64 {
        self.bytes.lock().unwrap().len() as u64
    }
    async fn read(&self, offset: u64, len: u32) -> DevResult<Vec<u8>> {
        let b = self.bytes.lock().unwrap();
        check_range(b.len() as u64, offset, len as u64)?;
        Ok(b[offset as usize..offset as usize + len as usize].to_vec())
    }
    async fn write(&self, offset: u64, data: Vec<u8>) -> DevResult<()> {
        let mut b = self.bytes.lock().unwrap();
        check_range(b.len() as u64, offset, data.len() as u64)?;
        b[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
        Ok(())
    }
    async fn flush(&self) -> DevResult<()> {
        Ok(())
    }
    async fn trim(&self, offset: u64, len: u64) -> DevResult<()> {
        self.write_zeroes(offset, len).await
    }
    async fn write_zeroes(&self, offset: u64, len: u64) -> DevResult<()> {
        let mut b = self.bytes.lock().unwrap();
        check_range(b.len() as u64, offset, len)?;
        b[offset as usize..(offset + len) as usize].fill(0);
        Ok(())
    }
}
