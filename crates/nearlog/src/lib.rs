//! Near-compute log (SplitFT, its "Near-Compute Log" slides): an application's
//! small synchronous log writes are replicated to spare memory lent by *log peers* and
//! acknowledged once a majority holds them; bulk files go to disaggregated storage untouched.
//!
//! The crate has the shape every system crate has: messages in [`proto`], deterministic state
//! machines in [`core`], the drivers (sockets, files, clocks) in [`driver`], and where the
//! controller's state is kept in [`store`]. Cores and drivers import the messages from [`proto`],
//! never each other.
//!
//! Sans-I/O cores (the slides' "NCL library", "log peer" and "controller"):
//! - [`core::file_client::FileClient`]: one open log file — recovery from the most advanced
//!   member of a majority (highest epoch, then longest prefix; corrupt replicas excluded by
//!   checksum), then ordered replication with majority acknowledgement, replicated size and
//!   truncation.
//! - [`core::peer::PeerCore`]: a bounded lent region of file images with per-block CRC32C; a
//!   full region refuses loudly, never writes short.
//! - [`core::controller::ControllerCore`]: peers, free space, placement, epochs, persisted
//!   through [`store::MetaStore`] (JSON file by default).
//!
//! Drivers:
//! - [`driver::mover`]: taking a peer's memory back — files re-placed by the controller are
//!   moved to their new set at a new epoch (a fenced application writer resumes on its own).
//! - [`driver::reseed`]: a file whose peers all lost it (restarted) re-seeded from its local
//!   copy once the operator accepts that copy.
//! - [`driver::blocking`]: the std-only client transport (what the LD_PRELOAD shim uses: no
//!   tokio inside applications); `driver::server` (feature `server`) holds the tokio daemons.
//!
//! Messages are in [`proto`], framed by the `wire` crate.

pub mod core;
pub mod driver;
pub mod proto;
pub mod store;
