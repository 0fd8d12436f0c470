//! Near-compute log (SplitFT, its "Near-Compute Log" slides): an application's
//! small synchronous log writes are replicated to spare memory lent by *log peers* and
//! acknowledged once a majority holds them; bulk files go to disaggregated storage untouched.
//!
//! Sans-I/O cores (the slides' "NCL library", "log peer" and "controller"):
//! - [`client::FileClient`]: one open log file — recovery from the most advanced member of a
//!   majority (highest epoch, then longest prefix; corrupt replicas excluded by checksum), then
//!   ordered replication with majority acknowledgement, replicated size and truncation.
//! - [`peer::PeerCore`]: a bounded lent region of file images with per-block CRC32C; a full
//!   region refuses loudly, never writes short.
//! - [`controller::ControllerCore`]: peers, free space, placement, epochs, persisted through
//!   [`controller::MetaStore`] (JSON file by default).
//!
//! - [`mover`]: taking a peer's memory back — files re-placed by the controller are moved to
//!   their new set at a new epoch (a fenced application writer resumes on its own).
//! - [`reseed`]: a file whose peers all lost it (restarted) re-seeded from its local copy
//!   once the operator accepts that copy.
//!
//! Messages are in [`proto`], framed by the `wire` crate. [`blocking`] is the std-only client
//! transport (what the LD_PRELOAD shim uses: no tokio inside applications); `server` (feature
//! `server`) holds the tokio daemons.

pub mod blocking;
pub mod client;
pub mod controller;
pub mod mover;
pub mod peer;
pub mod proto;
pub mod reseed;
#[cfg(feature = "server")]
pub mod server;
