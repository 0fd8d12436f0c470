//! The shim's state and the real work behind each intercepted call (`lib.rs` holds the
//! exported C symbols and calls in here), one file per job:
//!
//! - [`process`]: processes, locks and signals — glibc's functions, the reentrancy guard, the
//!   lock-free fd bitmaps, vfork detection, the load-time initialisation and the fork handlers
//!   (the crate doc's audit is about this file and the lock order it names);
//! - [`settings`]: the environment's settings and the path patterns;
//! - [`state`]: the replication state (one per process, under one lock) and its pump;
//! - [`open`]: open/creat of a log file and making a local copy current; [`known`]: local
//!   copies known to be current; [`listing`]: `opendir`; [`local`]: the local copy's I/O;
//! - [`write`]: write/writev/fsync/ftruncate; [`fds`]: close/dup/fcntl/mmap; [`names`]:
//!   rename/unlink.
//!
//! The items of each file are visible to the others (`pub(super)`, and every file starts with
//! `use super::*`), so moving a function between files changes no behaviour.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, CStr};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libc::{c_int, c_void, iovec, mode_t, off_t, size_t, ssize_t};
use nearlog::driver::blocking;
use nearlog::core::file_client::{ClientConfig, Failure, FileClient, Input};
use nearlog::proto::{CtlReply, CtlRequest, FileGrant, Op, PeerId, PeerReply, PeerRequest, MAX_CHUNK_BYTES, MAX_FRAME_BYTES};

use crate::forklock::ForkLock;
use crate::O_NCL;

mod process;
mod settings;
mod state;
mod local;
mod open;
mod known;
mod listing;
mod write;
mod fds;
mod names;

use fds::*;
use known::*;
use listing::*;
use local::*;
use open::*;
use process::*;
use settings::*;
use state::*;
use write::*;

// What `lib.rs` and `stdio.rs` call.
pub(crate) use fds::{close, dup, dup3, fcntl, mmap};
pub(crate) use listing::before_opendir;
pub(crate) use names::{rename, unlink_at};
pub(crate) use open::{before_read, open_at};
pub(crate) use process::{enter, real};
pub use settings::glob_match;
pub(crate) use settings::{is_log_fd, is_log_stream_path};
pub(crate) use write::{ftruncate, sync, write, writev, SyncKind};
