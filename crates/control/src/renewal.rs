//! When to renew a lease and when to consider it lost: the decision core of
//! [`crate::LeaseKeeper`] (sans-I/O, the workspace's one core API: `handle(now_us, input)`,
//! `take_outputs()`, `check_invariants()`; the keeper's task is its driver).
//!
//! The rule that makes a holder safe: etcd renews a lease no earlier than it received the
//! renewal, which is after the holder *sent* it; so the lease is valid at least until
//! `sent + ttl` of the last renewal that succeeded, and no later can the holder be sure of it.
//! At that instant, unless a later renewal succeeded, the holder declares the lease lost and
//! stops acting (self-fencing), before anyone else can have been granted what it held.

/// What the driver tells the core.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// Time passed (the driver wakes at [`Renewal::next_wakeup_us`]).
    Tick,
    /// The renewal sent at `sent_at_us` succeeded.
    Renewed { sent_at_us: u64 },
    /// The store says the lease is gone.
    Expired,
    /// The renewal got no answer or an error; the lease may still be valid.
    Failed,
}

/// What the core asks of the driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    /// Send one renewal now (and answer with `Renewed { sent_at_us: now }`, `Expired` or `Failed`).
    Renew,
    /// The lease is lost, for this reason: stop acting on it.
    Lost(String),
}

/// The renewal state of one lease.
#[derive(Debug)]
pub struct Renewal {
    ttl_us: u64,
    /// The lease is surely valid until here (the send time of the last success plus the TTL).
    valid_until_us: u64,
    /// When the next renewal is due.
    next_renew_us: u64,
    /// A renewal is out (sent at this time) and not yet answered.
    in_flight: Option<u64>,
    lost: Option<String>,
    outputs: Vec<Output>,
}

/// After a failed renewal, the wait before the next try: long enough not to spin on a dead
/// member, short against any TTL worth having.
const RETRY_AFTER_FAILURE_US: u64 = 100_000;

impl Renewal {
    /// A lease of `ttl_us` granted by a request sent at `granted_at_us`.
    pub fn new(ttl_us: u64, granted_at_us: u64) -> Renewal {
        Renewal { ttl_us, valid_until_us: granted_at_us + ttl_us, next_renew_us: granted_at_us + ttl_us / 3, in_flight: None, lost: None, outputs: Vec::new() }
    }

    pub fn handle(&mut self, now_us: u64, input: Input) {
        if self.lost.is_some() {
            return;
        }
        match input {
            Input::Tick => {}
            Input::Renewed { sent_at_us } => {
                self.in_flight = None;
                if sent_at_us < self.valid_until_us {
                    self.valid_until_us = self.valid_until_us.max(sent_at_us + self.ttl_us);
                    self.next_renew_us = sent_at_us + self.ttl_us / 3;
                }
            }
            Input::Expired => self.lose("the store says the lease expired".to_string()),
            Input::Failed => {
                self.in_flight = None;
                self.next_renew_us = now_us + RETRY_AFTER_FAILURE_US;
            }
        }
        if self.lost.is_some() {
        } else if now_us >= self.valid_until_us {
            let ttl_ms = self.ttl_us / 1000;
            self.lose(format!("not renewed within its TTL of {ttl_ms} ms"));
        } else if self.in_flight.is_none() && now_us >= self.next_renew_us {
            self.in_flight = Some(now_us);
            self.outputs.push(Output::Renew);
        }
        #[cfg(debug_assertions)]
        self.check_invariants();
    }

    fn lose(&mut self, why: String) {
        if self.lost.is_none() {
            self.lost = Some(why.clone());
            self.outputs.push(Output::Lost(why));
        }
    }

    pub fn take_outputs(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.outputs)
    }

    /// When the driver must wake next (a renewal due, or the end of sure validity).
    pub fn next_wakeup_us(&self) -> u64 {
        if self.in_flight.is_some() {
            self.valid_until_us
        } else {
            self.next_renew_us.min(self.valid_until_us)
        }
    }

    /// Until when the lease is surely valid.
    pub fn valid_until_us(&self) -> u64 {
        self.valid_until_us
    }

    pub fn is_lost(&self) -> bool {
        self.lost.is_some()
    }

    /// Panics naming a broken rule.
    pub fn check_invariants(&self) {
        assert!(self.ttl_us > 0, "a lease has a TTL");
        assert!(self.lost.is_some() || self.next_renew_us <= self.valid_until_us + RETRY_AFTER_FAILURE_US, "renewal due {} after validity ends {}", self.next_renew_us, self.valid_until_us);
        if let Some(sent) = self.in_flight {
            assert!(sent < self.valid_until_us, "a renewal was sent at {sent}, after validity ended at {}", self.valid_until_us);
        }
        let renews = self.outputs.iter().filter(|o| **o == Output::Renew).count();
        assert!(renews <= 1, "{renews} renewals asked at once");
        if let Some(lost_at) = self.outputs.iter().position(|o| matches!(o, Output::Lost(_))) {
            assert!(!self.outputs[lost_at..].contains(&Output::Renew), "a renewal asked after the lease was lost");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: u64 = 3_000_000;

    #[test]
    fn renews_every_third_of_the_ttl_from_each_send() {
        let mut r = Renewal::new(TTL, 0);
        r.handle(999_999, Input::Tick);
        assert!(r.take_outputs().is_empty());
        assert_eq!(r.next_wakeup_us(), 1_000_000);
        r.handle(1_000_000, Input::Tick);
        assert_eq!(r.take_outputs(), vec![Output::Renew]);
        // Only one renewal out at a time.
        r.handle(1_500_000, Input::Tick);
        assert!(r.take_outputs().is_empty());
        // Validity counts from the send (1.0 s), not the answer (1.8 s).
        r.handle(1_800_000, Input::Renewed { sent_at_us: 1_000_000 });
        assert_eq!(r.valid_until_us(), 4_000_000);
        assert_eq!(r.next_wakeup_us(), 2_000_000);
        assert!(r.take_outputs().is_empty());
    }

    #[test]
    fn failures_are_retried_and_the_lease_is_lost_at_the_last_send_plus_ttl() {
        let mut r = Renewal::new(TTL, 0);
        r.handle(1_000_000, Input::Tick);
        assert_eq!(r.take_outputs(), vec![Output::Renew]);
        r.handle(1_200_000, Input::Renewed { sent_at_us: 1_000_000 });
        r.handle(2_000_000, Input::Tick);
        assert_eq!(r.take_outputs(), vec![Output::Renew]);
        r.handle(2_900_000, Input::Failed);
        assert!(r.take_outputs().is_empty(), "no retry before the pause");
        r.handle(3_000_000, Input::Tick);
        assert_eq!(r.take_outputs(), vec![Output::Renew]);
        r.handle(3_999_999, Input::Tick);
        assert!(r.take_outputs().is_empty());
        assert!(!r.is_lost());
        r.handle(4_000_000, Input::Tick);
        assert!(matches!(r.take_outputs().as_slice(), [Output::Lost(why)] if why.contains("3000 ms")));
        // Lost is final: a late answer changes nothing.
        r.handle(4_100_000, Input::Renewed { sent_at_us: 3_000_000 });
        r.handle(5_000_000, Input::Tick);
        assert!(r.take_outputs().is_empty());
        assert!(r.is_lost());
    }

    /// The renewal's timeout ends at the end of validity; its failure is handled a little later.
    #[test]
    fn a_failure_answered_after_validity_ended_loses_it() {
        let mut r = Renewal::new(TTL, 0);
        r.handle(1_000_000, Input::Tick);
        assert_eq!(r.take_outputs(), vec![Output::Renew]);
        r.handle(3_250_000, Input::Failed);
        assert!(matches!(r.take_outputs().as_slice(), [Output::Lost(_)]));
    }

    #[test]
    fn the_store_saying_expired_loses_it_at_once() {
        let mut r = Renewal::new(TTL, 0);
        r.handle(1_000_000, Input::Tick);
        r.take_outputs();
        r.handle(1_100_000, Input::Expired);
        assert!(matches!(r.take_outputs().as_slice(), [Output::Lost(why)] if why.contains("expired")));
    }
}
