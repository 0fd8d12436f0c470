//! Restarting the daemons of a local cluster (`understudy up`, `kv up`, `nearlog up`): when one
//! exits, it is started again after a backoff, on its own data, so that one daemon's crash (the
//! metadata service's, a CM's, a log peer's) is a short gap in that daemon, never an outage of
//! the cluster. A daemon that keeps failing (more than [`MAX_RESTARTS_PER_WINDOW`] exits within
//! [`RESTART_WINDOW`]) is given up on and reported: restarting it again would only hide a
//! broken disk or configuration behind a log that scrolls.
//!
//! [`RestartCore`] decides (sans I/O: which daemon to start again, when, and when to give up);
//! the clusters poll their children, feed it exits and clock ticks, and spawn what it says.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use crate::proc;

/// The wait before the first restart of a daemon that exited; doubled for each further exit
/// within the window, up to [`RESTART_BACKOFF_MAX`]. Short: the first restart of a daemon that
/// crashed once is what keeps the cluster's outage short.
pub const RESTART_BACKOFF_FIRST: Duration = Duration::from_millis(250);
/// The longest wait between restarts.
pub const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(4);
/// Restarts allowed within [`RESTART_WINDOW`]; the next exit within it gives the daemon up.
pub const MAX_RESTARTS_PER_WINDOW: usize = 5;
/// The window over which exits are counted.
pub const RESTART_WINDOW: Duration = Duration::from_secs(60);

/// How a supervisor restarts its daemons.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestartPolicy {
    pub backoff_first: Duration,
    pub backoff_max: Duration,
    pub max_restarts_per_window: usize,
    pub window: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            backoff_first: RESTART_BACKOFF_FIRST,
            backoff_max: RESTART_BACKOFF_MAX,
            max_restarts_per_window: MAX_RESTARTS_PER_WINDOW,
            window: RESTART_WINDOW,
        }
    }
}

impl RestartPolicy {
    /// The wait before restarting a daemon that exited `exits` times within the window (>= 1).
    pub fn backoff(&self, exits: usize) -> Duration {
        let doublings = exits.saturating_sub(1).min(16) as u32;
        self.backoff_first.saturating_mul(1 << doublings).min(self.backoff_max.max(self.backoff_first))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    /// Daemon `0` (its index) exited, or could not be started again.
    Exited(usize),
    /// The clock: restarts that are due are emitted.
    Tick,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Start daemon `0` again now (it is counted as running from here).
    Restart(usize),
    /// Daemon `child` exited `exits_in_window` times within the window: it stays down.
    GaveUp { child: usize, exits_in_window: usize },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Running,
    RestartAt(Instant),
    GaveUp,
}

#[derive(Debug)]
struct Restarts {
    state: State,
    /// When it exited, oldest first, within the window (all of them once given up).
    exits: VecDeque<Instant>,
}

/// The restart decisions for a fixed set of daemons, all running at first.
#[derive(Debug)]
pub struct RestartCore {
    policy: RestartPolicy,
    daemons: Vec<Restarts>,
    outputs: Vec<Output>,
}

impl RestartCore {
    pub fn new(policy: RestartPolicy, daemons: usize) -> RestartCore {
        RestartCore {
            policy,
            daemons: (0..daemons).map(|_| Restarts { state: State::Running, exits: VecDeque::new() }).collect(),
            outputs: vec![],
        }
    }

    pub fn policy(&self) -> &RestartPolicy {
        &self.policy
    }

    pub fn state(&self, child: usize) -> State {
        self.daemons[child].state
    }

    /// Exits of `child` counted in its current window.
    pub fn exits_in_window(&self, child: usize) -> usize {
        self.daemons[child].exits.len()
    }

    pub fn handle(&mut self, now: Instant, input: Input) {
        match input {
            Input::Exited(i) => {
                let policy = self.policy;
                let d = &mut self.daemons[i];
                // Only a running daemon can exit: a second report of one exit changes nothing.
                if d.state == State::Running {
                    while d.exits.front().is_some_and(|t| now.saturating_duration_since(*t) >= policy.window) {
                        d.exits.pop_front();
                    }
                    d.exits.push_back(now);
                    let n = d.exits.len();
                    if n > policy.max_restarts_per_window {
                        d.state = State::GaveUp;
                        self.outputs.push(Output::GaveUp { child: i, exits_in_window: n });
                    } else {
                        d.state = State::RestartAt(now + policy.backoff(n));
                    }
                }
            }
            Input::Tick => {
                for (i, d) in self.daemons.iter_mut().enumerate() {
                    if let State::RestartAt(t) = d.state {
                        if now >= t {
                            d.state = State::Running;
                            self.outputs.push(Output::Restart(i));
                        }
                    }
                }
            }
        }
        #[cfg(debug_assertions)]
        self.check_invariants();
    }

    pub fn take_outputs(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.outputs)
    }

    pub fn check_invariants(&self) {
        let max = self.policy.max_restarts_per_window;
        for (i, d) in self.daemons.iter().enumerate() {
            assert!(d.exits.iter().zip(d.exits.iter().skip(1)).all(|(a, b)| a <= b), "daemon {i}: exits out of order");
            match d.state {
                State::GaveUp => assert!(d.exits.len() > max, "daemon {i} given up after {} exits", d.exits.len()),
                State::Running => assert!(d.exits.len() <= max, "daemon {i} running after {} exits in the window", d.exits.len()),
                State::RestartAt(t) => {
                    let last = *d.exits.back().unwrap_or_else(|| panic!("daemon {i} waits for a restart but never exited"));
                    assert!(d.exits.len() <= max, "daemon {i} to be restarted after {} exits", d.exits.len());
                    assert!(t >= last && t - last <= self.policy.backoff_max.max(self.policy.backoff_first), "daemon {i}: restart at a wrong time");
                }
            }
        }
    }
}

/// One supervised daemon: this executable re-run with `args`, its output appended to `log`.
#[derive(Debug)]
pub struct Daemon {
    /// What it is, for messages ("metadata service", "shard 2").
    pub what: String,
    pub args: Vec<String>,
    pub log: PathBuf,
    /// None while it is down (between an exit and its restart, or given up).
    pub child: Option<Child>,
}

/// What a [`Supervisor::poll`] saw and did, one line each for the supervisor's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// `what` exited (or could not be started again); restarted after `restart_in` unless it
    /// is given up (then a [`Event::GaveUp`] follows).
    Exited { what: String, status: String, reason: String, log: PathBuf, restart_in: Option<Duration> },
    Restarted { what: String, pid: u32 },
    /// `what` exited `exits` times within `window`: it stays down.
    GaveUp { what: String, exits: usize, window: Duration, reason: String, log: PathBuf },
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Event::Exited { what, status, reason, log, restart_in: Some(d) } => {
                write!(f, "{what} exited ({status}): {reason}; restarting it in {} ms (log: {})", d.as_millis(), log.display())
            }
            Event::Exited { what, status, reason, log, restart_in: None } => {
                write!(f, "{what} exited ({status}): {reason} (log: {})", log.display())
            }
            Event::Restarted { what, pid } => write!(f, "{what} restarted (pid {pid})"),
            Event::GaveUp { what, exits, window, reason, log } => write!(
                f,
                "{what} keeps failing ({exits} exits within {} s), last: {reason}; not restarting it again (log: {})",
                window.as_secs(),
                log.display()
            ),
        }
    }
}

/// Daemons restarted by a [`RestartCore`] when they exit.
#[derive(Debug)]
pub struct Supervisor {
    pub daemons: Vec<Daemon>,
    core: RestartCore,
    /// False: an exited daemon is reported and left down (for a test that restarts or
    /// replaces daemons itself).
    restart: bool,
}

impl Supervisor {
    /// Restarts per `policy`; None: reports exits and restarts nothing.
    pub fn new(policy: Option<RestartPolicy>, daemons: Vec<Daemon>) -> Supervisor {
        let core = RestartCore::new(policy.unwrap_or_default(), daemons.len());
        Supervisor { daemons, core, restart: policy.is_some() }
    }

    pub fn pid(&self, i: usize) -> Option<u32> {
        self.daemons[i].child.as_ref().map(Child::id)
    }

    pub fn state(&self, i: usize) -> State {
        self.core.state(i)
    }

    /// Whether any daemon was given up on.
    pub fn gave_up(&self) -> bool {
        (0..self.daemons.len()).any(|i| self.core.state(i) == State::GaveUp)
    }

    /// Reaps the daemons that exited and starts again those whose backoff is over.
    pub fn poll(&mut self) -> Vec<Event> {
        let now = Instant::now();
        let mut events = vec![];
        for i in 0..self.daemons.len() {
            let d = &mut self.daemons[i];
            let Some(c) = &mut d.child else { continue };
            if let Ok(Some(st)) = c.try_wait() {
                d.child = None;
                let status = proc::describe_status(st);
                self.exited(now, i, status, &mut events);
            }
        }
        self.core.handle(now, Input::Tick);
        for out in self.core.take_outputs() {
            if let Output::Restart(i) = out {
                let d = &mut self.daemons[i];
                match proc::spawn_self(&d.args, &d.log, &[]) {
                    Ok(c) => {
                        events.push(Event::Restarted { what: d.what.clone(), pid: c.id() });
                        d.child = Some(c);
                    }
                    Err(e) => self.exited(now, i, format!("could not start: {e:#}"), &mut events),
                }
            }
        }
        events
    }

    fn exited(&mut self, now: Instant, i: usize, status: String, events: &mut Vec<Event>) {
        let d = &self.daemons[i];
        let reason = proc::last_error(&d.log);
        if !self.restart {
            events.push(Event::Exited { what: d.what.clone(), status, reason, log: d.log.clone(), restart_in: None });
            return;
        }
        self.core.handle(now, Input::Exited(i));
        let restart_in = match self.core.state(i) {
            State::RestartAt(t) => Some(t.saturating_duration_since(now)),
            _ => None,
        };
        events.push(Event::Exited { what: d.what.clone(), status, reason: reason.clone(), log: d.log.clone(), restart_in });
        for out in self.core.take_outputs() {
            if let Output::GaveUp { child, exits_in_window } = out {
                let d = &self.daemons[child];
                events.push(Event::GaveUp {
                    what: d.what.clone(),
                    exits: exits_in_window,
                    window: self.core.policy().window,
                    reason: reason.clone(),
                    log: d.log.clone(),
                });
            }
        }
    }

    /// Takes the running children out (the caller stops them, in its order); nothing is
    /// restarted afterwards.
    pub fn take_children(&mut self, range: std::ops::Range<usize>) -> Vec<(String, Child)> {
        self.daemons[range].iter_mut().filter_map(|d| d.child.take().map(|c| (d.what.clone(), c))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// One exit: restarted after the first backoff, not before.
    #[test]
    fn an_exited_daemon_is_restarted_after_the_backoff() {
        let t0 = Instant::now();
        let mut c = RestartCore::new(RestartPolicy::default(), 3);
        c.handle(t0, Input::Exited(1));
        c.handle(t0 + ms(100), Input::Tick);
        assert_eq!(c.take_outputs(), vec![]);
        c.handle(t0 + RESTART_BACKOFF_FIRST, Input::Tick);
        assert_eq!(c.take_outputs(), vec![Output::Restart(1)]);
        assert_eq!(c.state(1), State::Running);
        c.handle(t0 + ms(5000), Input::Tick);
        assert_eq!(c.take_outputs(), vec![], "restarted once only");
    }

    /// Exits in a row double the wait up to the cap; the exit past the bound gives up, and a
    /// given-up daemon is never restarted.
    #[test]
    fn a_daemon_that_keeps_failing_backs_off_and_is_given_up() {
        let p = RestartPolicy::default();
        let t0 = Instant::now();
        let mut c = RestartCore::new(p, 1);
        let mut now = t0;
        let mut waits = vec![];
        for _ in 0..MAX_RESTARTS_PER_WINDOW {
            c.handle(now, Input::Exited(0));
            let State::RestartAt(t) = c.state(0) else { panic!("{:?}", c.state(0)) };
            waits.push(t - now);
            now = t;
            c.handle(now, Input::Tick);
            assert_eq!(c.take_outputs(), vec![Output::Restart(0)]);
        }
        assert_eq!(waits, vec![ms(250), ms(500), ms(1000), ms(2000), ms(4000)]);
        c.handle(now, Input::Exited(0));
        assert_eq!(c.take_outputs(), vec![Output::GaveUp { child: 0, exits_in_window: MAX_RESTARTS_PER_WINDOW + 1 }]);
        c.handle(now + ms(60_000), Input::Tick);
        c.handle(now + ms(60_000), Input::Exited(0));
        assert_eq!(c.take_outputs(), vec![]);
        assert_eq!(c.state(0), State::GaveUp);
    }

    /// Exits spread wider than the window never add up to giving up, and the backoff falls back
    /// to the first wait once old exits leave the window.
    #[test]
    fn exits_older_than_the_window_are_forgotten() {
        let t0 = Instant::now();
        let mut c = RestartCore::new(RestartPolicy::default(), 1);
        for k in 0..20u32 {
            let now = t0 + RESTART_WINDOW * k;
            c.handle(now, Input::Exited(0));
            assert_eq!(c.state(0), State::RestartAt(now + RESTART_BACKOFF_FIRST), "exit {k}");
            c.handle(now + RESTART_BACKOFF_FIRST, Input::Tick);
            assert_eq!(c.take_outputs(), vec![Output::Restart(0)]);
        }
    }

    /// A second report of the same exit (while the restart is pending) does not count twice.
    #[test]
    fn an_exit_reported_twice_counts_once() {
        let t0 = Instant::now();
        let mut c = RestartCore::new(RestartPolicy::default(), 2);
        c.handle(t0, Input::Exited(0));
        c.handle(t0 + ms(1), Input::Exited(0));
        assert_eq!(c.exits_in_window(0), 1);
        assert_eq!(c.state(1), State::Running);
    }

    #[test]
    #[should_panic(expected = "running after")]
    fn check_invariants_names_a_broken_invariant() {
        let mut c = RestartCore::new(RestartPolicy::default(), 1);
        let now = Instant::now();
        for _ in 0..=MAX_RESTARTS_PER_WINDOW {
            c.daemons[0].exits.push_back(now);
        }
        c.check_invariants();
    }
}
