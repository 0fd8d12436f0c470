//! The instance pool (§4.1) and the parts that run and take down an instance's processes.

mod local;
pub mod process;
pub mod teardown;
pub mod unit;

pub use local::*;
pub use process::pid_alive;
