//! The tokio drivers: sockets, files and clocks around the cores in [`crate::core`]. No decision
//! the simulation would have to copy lives here.

pub mod shard;
pub mod meta;
pub mod client;
pub mod leader;
