//! The drivers: sockets, files and clocks around the cores in [`crate::core`]. [`blocking`],
//! [`mover`] and [`reseed`] are std-only (the LD_PRELOAD shim links them: no tokio inside
//! applications); `server` (feature `server`) holds the tokio daemons.

pub mod blocking;
pub mod mover;
pub mod reseed;
#[cfg(feature = "server")]
pub mod server;
#[cfg(feature = "server")]
pub mod control_store;
