//! The sans-I/O cores of the witness KV (CANDStore): deterministic state machines with no
//! socket, clock, file or thread. [`node::WitnessCore`] is one node of any kind; [`config`] the
//! group's membership and quorums; [`page`] the backup's SSD page format.

pub mod config;
pub mod node;
pub mod page;

#[cfg(test)]
mod tests;
