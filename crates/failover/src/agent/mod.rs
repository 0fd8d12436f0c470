//! Failover across hosts (issue 24, item 5): a failover agent per host starts and kills the
//! monitor's instances there, so losing one machine loses at most one of primary and backup.
//!
//! * [`proto`]: the agent's requests and replies, and their framing (bounded).
//! * [`server`]: the agent itself, a [`crate::pool::LocalPool`] per application on its host,
//!   registered in the control store under a lease ([`proto::AGENT_KIND`]).
//! * [`remote`]: [`RemotePool`], the monitor's [`crate::pool::InstancePool`] over the agents.
//! * [`placement`]: which host a new instance goes to (never the primary's when another is live).

pub mod placement;
pub mod proto;
pub mod remote;
pub mod server;

pub use remote::{RemotePool, RemotePoolConfig};
pub use server::{Agent, AgentConfig};
