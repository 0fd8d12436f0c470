//! Speculative failover for applications on Understudy volumes (SpecREDS §3, §4.1, §4.3, §4.4,
//! §5): a failure monitor, an instance pool and a client endpoint.
//!
//! * [`proto`]: what the core and its drivers share — the monitor's inputs ([`Input`]), actions
//!   ([`Action`]), events ([`Event`]), configuration and persisted state ([`Durable`]).
//! * [`core`]: the monitor's decisions as a deterministic sans-I/O state machine
//!   ([`core::Monitor`]: `handle(now_ms, input)`, `take_outputs()`, `check_invariants()`; inputs
//!   are ping results, instance events, volume-operation results and ticks) with three policies
//!   — REDS (timeout, fence, restart on the same volume), speculative (first missed ping →
//!   `super` + backup on the child → `collapse` → promote or abort; REDS after repeated aborts)
//!   and oracle (evaluation only). It imports only [`proto`].
//! * [`journal`]: the monitor's state on disk, written before every irreversible step.
//! * [`spec`]: the instance spec (command, environment, volume, mount point, health check),
//!   TOML or JSON, validated.
//! * [`pool`]: the instance pool trait and its local-process implementation (a process tree
//!   per instance with its own attached volume; SIGKILL, SIGSTOP, clean stop); [`pool::process`]
//!   the pid helpers under it.
//! * [`netns`]: each instance's application in its own network namespace behind a veth pair
//!   (Linux, root), so a network cut-off is its link going down while its disk stays attached.
//! * [`pool::teardown`]: an instance's volume stack (ext4 → loop → FUSE) taken down in the order
//!   that cannot wedge the kernel (FUSE connection aborted, loop released, helper killed last),
//!   every command with a deadline.
//! * [`pool::unit`]: an instance's application as a unit that dies whole (a cgroup v2 group per
//!   application, killed with `cgroup.kill`; without cgroup2, a freeze-and-kill of its process
//!   tree): a process group is not one (PostgreSQL puts every backend in its own session).
//! * [`endpoint`]: the TCP proxy clients use (the "elastic IP" of §4.3), re-pointable, severing
//!   every connection to the old primary.
//! * [`agent`]: failover across hosts — the agent that starts instances on its host for the
//!   monitor, and the monitor's [`agent::RemotePool`] over the agents (placement on another
//!   host than the primary's).
//! * [`driver`]: the tokio runtime driver that runs the core against the real pool, endpoint and
//!   volume service; its control port reports status and injects faults (tests, benchmarks).
//! * [`health`]: the health probes the monitor's pings run (a command, a PostgreSQL or MySQL
//!   query, a line over TCP).
//! * [`load`]: the load generator (SQLite front or PostgreSQL): records every acknowledged
//!   commit and the client-side throughput timeline, then checks the table (benchmarks and
//!   `understudy failover load`; the monitor does not use it).
//! * [`pg`], [`mysql`]: tiny PostgreSQL and MySQL/MariaDB protocol clients (no password, text
//!   queries) for health checks and load.

pub mod agent;
pub mod core;
pub mod driver;
pub mod endpoint;
pub mod health;
pub mod journal;
pub mod load;
pub mod mysql;
pub mod netns;
pub mod pg;
pub mod pool;
pub mod proto;
pub mod spec;

pub use crate::core::Monitor;
pub use crate::proto::{Action, CollapseOutcome, Durable, Event, Input, InstanceId, MonitorConfig, Phase, PolicyKind};
