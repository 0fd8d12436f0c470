//! An NBD (Network Block Device) server for any [`blockdev::BlockDev`], written by hand.
//!
//! It speaks the fixed newstyle handshake (NBD_OPT_EXPORT_NAME, GO, INFO, LIST, ABORT, and
//! STARTTLS when built [`Server::with_tls`], which then requires it: the spec's FORCEDTLS, see
//! [`proto::tls_gate`]; every other option, including STRUCTURED_REPLY and META_CONTEXT, is
//! answered NBD_REP_ERR_UNSUP) and simple replies in transmission (READ, WRITE, DISC, FLUSH, TRIM,
//! WRITE_ZEROES; FUA and NO_HOLE accepted). Each connection reads requests in order, runs up to
//! [`ServerConfig::max_in_flight_requests_per_connection`] of them at once on their own tasks
//! and sends the replies through a single writer; many connections are served at once, which is
//! why exports advertise CAN_MULTI_CONN. Real clients (qemu-io, qemu-img, nbdcopy, fio's nbd
//! engine, nbdfuse) are tested against it in `tests/`.
//!
//! Main types: [`Server`] with its [`ServerConfig`] limits, the [`Exports`] trait that maps
//! export names to devices ([`SingleExport`], [`MapExports`]), and the free functions
//! [`serve_tcp`] and [`serve_unix`]. The wire format lives in [`proto`] as pure functions over
//! byte slices ([`proto::parse_request_header`], [`proto::plan_request`], ...), so it can be
//! fuzzed: `cd crates/nbd/fuzz && cargo +nightly fuzz run request_parser`.
//!
//! Bad input never panics the server and never disturbs other connections: a wrong request
//! magic closes the connection; a READ/WRITE over [`ServerConfig::max_request_bytes`] (32 MiB) or
//! outside the device gets EINVAL (a refused write's payload is read and discarded in small
//! chunks, or, above [`ServerConfig::max_discard_payload_bytes`], the connection is closed).
//! Device errors map to errnos: OutOfRange→EINVAL, WriteRefused→EPERM, NoSpace→ENOSPC, Io→EIO.

pub mod exports;
pub mod proto;
mod server;

pub use exports::{Exports, MapExports, SingleExport};
pub use server::{serve_tcp, serve_unix, ConnError, Server, ServerConfig};
