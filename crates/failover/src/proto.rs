//! The failure monitor's protocol: what the core ([`crate::core::Monitor`]) and its drivers
//! (the runtime driver [`crate::driver`], the journal, the instance pool, the simulation in
//! `tests/sim.rs`) share, so they import this and never each other: the inputs the monitor takes
//! ([`Input`]), the actions it asks for ([`Action`]) and the events it reports ([`Event`]), its
//! configuration ([`MonitorConfig`]) and the state it persists ([`Durable`], [`Phase`]).

use serde::{Deserialize, Serialize};

/// The runtime's clock: wall-clock milliseconds since the Unix epoch. The runtime driver gives
/// the core its `now` from it; the pool stamps [`crate::pool::StartTiming`] with it.
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// An application instance, numbered by the monitor (never reused).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct InstanceId(pub u64);

impl std::fmt::Display for InstanceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "i{}", self.0)
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    /// Recovery from disaggregated storage: wait a timeout, fence, restart on the same volume.
    Reds,
    /// Speculative recovery (§3, §4.1): super + backup at the first missed ping, collapse.
    Speculative,
    /// Evaluation only: told the future by [`Input::OracleHint`], takes the shorter path.
    Oracle,
}

impl std::str::FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "reds" => Ok(PolicyKind::Reds),
            "speculative" => Ok(PolicyKind::Speculative),
            "oracle" => Ok(PolicyKind::Oracle),
            _ => Err(format!("unknown policy {s:?} (reds, speculative or oracle)")),
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollapseOutcome {
    Promoted,
    Rejected,
}

/// Timing and limits of the monitor.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct MonitorConfig {
    pub policy: PolicyKind,
    /// How often the primary is pinged.
    pub ping_interval_ms: u64,
    /// How often an instance that is starting (a backup, a REDS restart, the first primary) is
    /// pinged until it answers: much tighter than `ping_interval_ms`, so a recovered instance
    /// is noticed within this much rather than a whole ping interval (a refused connection
    /// costs next to nothing).
    pub backup_ping_interval_ms: u64,
    /// REDS (and speculative's fallback): how long the primary must stay silent before it is
    /// fenced and restarted.
    pub reds_timeout_ms: u64,
    /// Speculative: consecutive missed pings before `super` (the paper: the first one).
    pub speculate_after_missed_pings: u32,
    /// How long a started instance has to answer its first ping before it counts as failed.
    pub healthy_timeout_ms: u64,
    /// Starts of a backup (speculative: on one child) before the attempt is given up.
    pub max_backup_starts: u32,
    /// Speculative falls back to REDS after this many aborted attempts within `abort_window_ms`
    /// (fail-slow primaries, §4.4).
    pub max_aborts: u32,
    pub abort_window_ms: u64,
    /// Wait after a failed volume operation or endpoint change before retrying it.
    pub retry_backoff_ms: u64,
}

impl MonitorConfig {
    /// How often the driver must feed [`Input::Tick`]: often enough for both ping intervals.
    pub fn tick_interval_ms(&self) -> u64 {
        (self.ping_interval_ms / 2).min(self.backup_ping_interval_ms.max(1)).max(5)
    }
}

impl Default for MonitorConfig {
    fn default() -> Self {
        MonitorConfig {
            policy: PolicyKind::Speculative,
            ping_interval_ms: 500,
            backup_ping_interval_ms: 25,
            reds_timeout_ms: 60_000,
            speculate_after_missed_pings: 1,
            healthy_timeout_ms: 120_000,
            max_backup_starts: 3,
            max_aborts: 3,
            abort_window_ms: 600_000,
            retry_backoff_ms: 500,
        }
    }
}

/// Where the monitor is in a failover; persisted.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Starting the first primary (on `Durable::volume`); once healthy, point the endpoint.
    Booting { instance: InstanceId, since_ms: u64, healthy: bool },
    /// The primary serves; pings watch it.
    Normal,
    /// Speculative: `super` of the volume into `child` requested.
    Supering { child: String },
    /// Speculative: a backup recovers on `child` (restarted up to `max_backup_starts` times).
    Recovering { child: String, backup: InstanceId, attempt: u32, since_ms: u64, stopping: bool },
    /// Speculative: the backup is healthy; `collapse` requested.
    Collapsing { child: String, backup: InstanceId },
    /// Speculative: the child was promoted. Re-point the endpoint, kill the old primary.
    Promoting { backup: InstanceId, old: InstanceId, pointed: bool, old_stopped: bool },
    /// Speculative attempt given up: stop the backup (if any), drop the child (unless collapse
    /// already discarded it). The primary and its volume are untouched. `counts`: whether the
    /// attempt counts towards the REDS fallback (`max_aborts`): it does when speculation failed
    /// while the primary stayed silent (a rejected collapse: a primary that writes but does not
    /// answer, §4.4; a backup that cannot recover), not when the primary simply answered again
    /// (a false positive that healed: nothing for a timeout to force).
    Aborting {
        child: String,
        backup: Option<InstanceId>,
        backup_stopped: bool,
        child_dropped: bool,
        reason: String,
        #[serde(default = "counts_by_default")]
        counts: bool,
    },
    /// REDS: fence the old primary (kill it, detach its volume), then restart on the volume.
    RedsFencing { old: InstanceId },
    /// REDS: a new instance recovers on the very volume.
    RedsStarting { old: InstanceId, backup: InstanceId, attempt: u32, since_ms: u64, stopping: bool },
    /// REDS: the backup is healthy; re-point the endpoint.
    RedsPointing { backup: InstanceId },
    /// Nothing more to try (an application that never becomes healthy): needs an operator.
    /// The volume is intact. `last`: the instance started last (killed on giving up; killed
    /// again by a restarted monitor before it starts one, in case that kill never ran).
    Failed {
        reason: String,
        #[serde(default)]
        last: Option<InstanceId>,
    },
}

/// Journals written before `Phase::Aborting::counts` existed counted every abort.
fn counts_by_default() -> bool {
    true
}

/// The monitor's persistent state.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Durable {
    /// The volume of the current primary (after a promotion: the promoted child's name).
    pub volume: String,
    /// The instance the endpoint points at (or is to point at).
    pub primary: InstanceId,
    pub next_instance: u64,
    /// Numbers the children: `VOLUME.fo-N`.
    pub next_child: u64,
    pub phase: Phase,
    /// Times (ms) of recent aborted speculative attempts of the current primary that count
    /// towards the REDS fallback, newest last, at most `max_aborts`. Cleared by a failover
    /// (the history is the replaced primary's).
    pub aborts_ms: Vec<u64>,
    /// Completed failovers.
    pub failovers: u64,
    /// Start of the primary's current silence (first missed ping). Durable so that the REDS
    /// timeout runs on across restarts of the monitor instead of starting over each time.
    pub silent_since_ms: Option<u64>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// Timer; the driver calls it at least every `ping_interval_ms`.
    Tick,
    /// The driver is shutting down and has stopped every instance cleanly.
    Shutdown,
    PingOk(InstanceId),
    PingFailed(InstanceId),
    InstanceStarted(InstanceId),
    InstanceStartFailed { id: InstanceId, error: String },
    /// The instance's processes exited on their own.
    InstanceExited(InstanceId),
    /// A `KillInstance` finished: processes gone, volume detached.
    InstanceStopped(InstanceId),
    /// A `KillInstance` did not finish (a process that would not die, a volume that would not
    /// detach): the fence is not done, so it is issued again after `retry_backoff_ms`.
    KillFailed { id: InstanceId, error: String },
    EndpointPointed(InstanceId),
    /// The endpoint could not be re-pointed (retried).
    EndpointFailed { id: InstanceId, error: String },
    SuperDone { child: String },
    /// `super` failed; `existing_child` is set when the parent already has a (stale) child.
    SuperFailed { child: String, error: String, existing_child: Option<String> },
    CollapseDone { child: String, outcome: CollapseOutcome },
    CollapseFailed { child: String, error: String },
    ChildDropped { child: String },
    DropFailed { child: String, error: String },
    /// Oracle only: what will happen to the current failure, told by the evaluator.
    /// `primary_back_after_ms`: the primary answers again that long after it was first missed
    /// (None: never); `recovery_ms`: how long a restart on the volume takes.
    OracleHint { primary_back_after_ms: Option<u64>, recovery_ms: u64 },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Ping(InstanceId),
    StartInstance { id: InstanceId, volume: String },
    /// SIGKILL the whole instance and detach its volume (fencing); answered by `InstanceStopped`.
    KillInstance(InstanceId),
    PointEndpoint(InstanceId),
    /// Stop forwarding: sever every client connection and hold new ones until the next
    /// `PointEndpoint`. Issued (and carried out at once, in order) before every `Collapse`, so
    /// between a promoting collapse and the re-point no client can reach the old primary
    /// (§4.3); not answered.
    FreezeEndpoint,
    Super { parent: String, child: String },
    Collapse { parent: String, child: String },
    /// Discard a super child without promoting it (the parent is kept).
    DropChild { parent: String, child: String },
    Notify(Event),
}

/// What the monitor tells its operator (the CLI prints these as JSON lines).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    PrimaryUp { instance: InstanceId, volume: String },
    Suspected { instance: InstanceId },
    Superposed { parent: String, child: String },
    BackupStarted { instance: InstanceId, volume: String },
    BackupHealthy { instance: InstanceId },
    Promoted { instance: InstanceId, volume: String, failover_ms: u64 },
    Aborted { child: String, reason: String },
    RedsTimeout { instance: InstanceId },
    RedsRestarted { instance: InstanceId, volume: String, failover_ms: u64 },
    /// The primary answers again after a silence, without a failover.
    PrimaryAnswered { instance: InstanceId, silent_ms: u64 },
    GaveUp { reason: String },
}

/// What the monitor publishes for the client endpoints when it runs on the control store (the
/// `failover/primary/<name>` key): where clients go now. The endpoints (`failover endpoint`)
/// follow it; the monitor writes it instead of re-pointing an endpoint in its own process.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct PrimaryRecord {
    /// The instance clients go to (None while frozen).
    pub instance: Option<InstanceId>,
    /// Its address (None while frozen).
    pub addr: Option<std::net::SocketAddr>,
    /// Hold new connections and sever open ones (before a collapse or a fence).
    pub frozen: bool,
    /// The fencing token of the monitor that wrote it (its election key's create revision).
    pub writer: i64,
}
