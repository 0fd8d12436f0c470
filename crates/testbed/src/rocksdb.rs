//! The RocksDB load program: a small C program against Debian's librocksdb (synced WAL puts from
//! N client threads, and a crash-and-check mode), compiled with `cc` on demand; the nearlog
//! benchmark and crash test run it.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;

/// The load program's source; also used by the crash test.
pub const ROCKSDB_LOAD_C: &str = include_str!("nearlog_rocksdb.c");

/// Compiles the RocksDB load program into `dir` (needs cc and librocksdb-dev).
pub fn build_rocksdb_load(dir: &Path) -> anyhow::Result<PathBuf> {
    let src = dir.join("nearlog_rocksdb.c");
    let bin = dir.join("nearlog_rocksdb");
    std::fs::write(&src, ROCKSDB_LOAD_C)?;
    let out = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&bin)
        .arg(&src)
        .args(["-lrocksdb", "-lpthread"])
        .output()
        .context("cannot run cc (Debian package gcc)")?;
    anyhow::ensure!(out.status.success(), "compiling the RocksDB load program failed (Debian package librocksdb-dev?): {}", String::from_utf8_lossy(&out.stderr));
    Ok(bin)
}
