//! The tokio drivers of HEAL: the node server, the configuration manager's server and the
//! async clients.

pub mod events;
pub mod node;

pub use node::*;
