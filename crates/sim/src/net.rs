//! [`Network`]: a simulated message network that drops, duplicates, delays (hence reorders) and
//! partitions messages between nodes.

use std::collections::{BTreeMap, BTreeSet};
use std::marker::PhantomData;

use crate::rng::SimRng;
use crate::time::{EventQueue, QueueFull, TimeUs};

/// A node's address on the simulated network.
pub type NodeId = u32;

/// Fault settings, applied independently to every message.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NetConfig {
    /// Probability that a message is lost.
    pub drop_probability: f64,
    /// Probability that a (not dropped) message arrives twice, each copy with its own delay.
    pub duplicate_probability: f64,
    /// Each copy's delay is uniform in `delay_us_min..=delay_us_max`; a range wider than the
    /// gap between sends reorders messages.
    pub delay_us_min: u64,
    pub delay_us_max: u64,
}

/// A message in flight, as pushed into the harness's [`EventQueue`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery<M> {
    pub from: NodeId,
    pub to: NodeId,
    pub msg: M,
}

/// Message counts for test reports. Every copy ends in exactly one of `delivered` or `dropped_*`
/// once the harness has passed each popped delivery to [`Network::receive`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Calls to [`Network::send`].
    pub sent: u64,
    /// Extra copies created by duplication.
    pub duplicated: u64,
    /// Copies handed to the destination by [`Network::receive`].
    pub delivered: u64,
    /// Lost to `drop_probability`.
    pub dropped_random: u64,
    /// Lost because the link was cut at send time.
    pub dropped_cut: u64,
    /// Lost because the sender was down at send time or the receiver at delivery time.
    pub dropped_down: u64,
    /// Copies that reached a paused destination and were held for it (each is also counted
    /// `delivered` once [`Network::resume`] hands it over).
    pub held: u64,
}

impl NetStats {
    pub fn dropped(&self) -> u64 {
        self.dropped_random + self.dropped_cut + self.dropped_down
    }

    /// Copies sent but not yet delivered or dropped.
    pub fn in_flight(&self) -> u64 {
        self.sent + self.duplicated - self.delivered - self.dropped()
    }
}

/// The simulated network. It holds no messages itself: [`send`](Network::send) decides a
/// message's fate and pushes its copies, as `E::from(Delivery)`, into the harness's event queue;
/// when the harness pops one it calls [`receive`](Network::receive), which checks the destination
/// is up, and then hands the message to the destination core.
///
/// ```text
/// loop: (now, event) = queue.pop()
///   Event::Deliver(d) => if let Some(d) = net.receive(d) { outputs = cores[d.to].on_message(d.from, d.msg) }
///   for each output message m: net.send(&mut rng, &mut queue, now, d.to, m.to, m)?
/// ```
///
/// Partitions are checked at send time (a message already in flight when a link is cut still
/// arrives); "down" is checked both when sending (from) and when delivering (to). A node's
/// messages to itself are never cut.
///
/// A *paused* node (a process stopped by `SIGSTOP`, or descheduled on a loaded machine) is
/// alive but runs no code: messages that reach it wait in its input queue (the kernel's socket
/// buffers), virtual time runs on, and [`resume`](Network::resume) hands them all over, in
/// arrival order, for the harness to deliver at the resume time. The harness must hold the
/// paused node's own timers and disk completions likewise, and must not run its core (a paused
/// node sends nothing: [`send`](Network::send) panics if it tries).
pub struct Network<M> {
    config: NetConfig,
    cuts: BTreeSet<(NodeId, NodeId)>,
    isolated: BTreeSet<NodeId>,
    down: BTreeSet<NodeId>,
    /// Paused nodes, each with the messages that reached it while paused, in arrival order.
    paused: BTreeMap<NodeId, Vec<Delivery<M>>>,
    stats: NetStats,
    _msg: PhantomData<fn(M) -> M>,
}

impl<M: Clone> Network<M> {
    /// A fully connected network with every node up. Panics if a probability is outside
    /// `0.0..=1.0` or `delay_us_min > delay_us_max`.
    pub fn new(config: NetConfig) -> Self {
        for p in [config.drop_probability, config.duplicate_probability] {
            assert!(
                (0.0..=1.0).contains(&p),
                "NetConfig: probability {p} is outside 0.0..=1.0"
            );
        }
        assert!(
            config.delay_us_min <= config.delay_us_max,
            "NetConfig: delay_us_min ({}) > delay_us_max ({})",
            config.delay_us_min,
            config.delay_us_max
        );
        Self {
            config,
            cuts: BTreeSet::new(),
            isolated: BTreeSet::new(),
            down: BTreeSet::new(),
            paused: BTreeMap::new(),
            stats: NetStats::default(),
            _msg: PhantomData,
        }
    }

    /// Sends `msg` from `from` to `to` at time `now`: drops it (sender down, link cut, or at
    /// random), or pushes one or two copies into `queue`, each at `now + delay`.
    /// Fails only if the queue is full.
    pub fn send<E: From<Delivery<M>>>(
        &mut self,
        rng: &mut SimRng,
        queue: &mut EventQueue<E>,
        now: TimeUs,
        from: NodeId,
        to: NodeId,
        msg: M,
    ) -> Result<(), QueueFull> {
        assert!(
            !self.is_paused(from),
            "node {from} sent a message while paused: a paused process runs no code (harness bug)"
        );
        self.stats.sent += 1;
        if self.is_down(from) {
            self.stats.dropped_down += 1;
            return Ok(());
        }
        if self.is_cut(from, to) {
            self.stats.dropped_cut += 1;
            return Ok(());
        }
        if rng.chance(self.config.drop_probability) {
            self.stats.dropped_random += 1;
            return Ok(());
        }
        if rng.chance(self.config.duplicate_probability) {
            let delay_us = rng.range_u64(self.config.delay_us_min, self.config.delay_us_max);
            queue.push_after(
                now,
                delay_us,
                Delivery {
                    from,
                    to,
                    msg: msg.clone(),
                }
                .into(),
            )?;
            self.stats.duplicated += 1;
        }
        let delay_us = rng.range_u64(self.config.delay_us_min, self.config.delay_us_max);
        queue.push_after(now, delay_us, Delivery { from, to, msg }.into())
    }

    /// Call with each delivery popped from the queue: returns it if the destination is up (and
    /// counts it delivered), or `None` if the destination is down (counted dropped) or paused
    /// (held until [`resume`](Network::resume)).
    pub fn receive(&mut self, delivery: Delivery<M>) -> Option<Delivery<M>> {
        if self.is_down(delivery.to) {
            self.stats.dropped_down += 1;
            return None;
        }
        if let Some(held) = self.paused.get_mut(&delivery.to) {
            self.stats.held += 1;
            held.push(delivery);
            return None;
        }
        self.stats.delivered += 1;
        Some(delivery)
    }

    /// Pauses `node`: from now on messages that reach it are held (see the type's docs).
    /// Pausing a paused node changes nothing.
    pub fn pause(&mut self, node: NodeId) {
        self.paused.entry(node).or_default();
    }

    /// Resumes `node`: returns the messages held for it, in arrival order, each counted
    /// delivered; the harness delivers them now. Empty if `node` was not paused.
    pub fn resume(&mut self, node: NodeId) -> Vec<Delivery<M>> {
        let held = self.paused.remove(&node).unwrap_or_default();
        self.stats.delivered += held.len() as u64;
        held
    }

    pub fn is_paused(&self, node: NodeId) -> bool {
        self.paused.contains_key(&node)
    }

    /// Cuts the link `a -> b` (one direction).
    pub fn cut(&mut self, a: NodeId, b: NodeId) {
        self.cuts.insert((a, b));
    }

    /// Cuts `a -> b` and `b -> a`.
    pub fn cut_both(&mut self, a: NodeId, b: NodeId) {
        self.cut(a, b);
        self.cut(b, a);
    }

    /// Cuts every link to and from `node`, including to nodes that join later.
    pub fn isolate(&mut self, node: NodeId) {
        self.isolated.insert(node);
    }

    /// Removes every cut and isolation (down nodes stay down).
    pub fn heal_all(&mut self) {
        self.cuts.clear();
        self.isolated.clear();
    }

    /// Whether messages from `a` to `b` are dropped by a partition. Never true for `a == b`.
    pub fn is_cut(&self, a: NodeId, b: NodeId) -> bool {
        a != b
            && (self.cuts.contains(&(a, b))
                || self.isolated.contains(&a)
                || self.isolated.contains(&b))
    }

    /// Marks `node` down (crashed: it sends and receives nothing) or up again.
    pub fn set_down(&mut self, node: NodeId, down: bool) {
        if down {
            self.down.insert(node);
        } else {
            self.down.remove(&node);
        }
    }

    pub fn is_down(&self, node: NodeId) -> bool {
        self.down.contains(&node)
    }

    pub fn stats(&self) -> NetStats {
        self.stats
    }

    pub fn config(&self) -> NetConfig {
        self.config
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(drop_probability: f64, duplicate_probability: f64) -> NetConfig {
        NetConfig {
            drop_probability,
            duplicate_probability,
            delay_us_min: 10,
            delay_us_max: 1000,
        }
    }

    /// Sends `count` numbered messages from 0 to 1, one per microsecond, then drains the queue.
    /// Returns (delivery time, message) in delivery order.
    fn run(net: &mut Network<u32>, seed: u64, count: u32) -> Vec<(TimeUs, u32)> {
        let mut rng = SimRng::new(seed);
        let mut queue: EventQueue<Delivery<u32>> = EventQueue::new(10_000);
        for i in 0..count {
            net.send(&mut rng, &mut queue, i as TimeUs, 0, 1, i)
                .unwrap();
        }
        let mut out = Vec::new();
        while let Some((time, d)) = queue.pop() {
            if let Some(d) = net.receive(d) {
                out.push((time, d.msg));
            }
        }
        out
    }

    #[test]
    fn lossless_network_delivers_every_message_exactly_once_and_reorders() {
        let mut net = Network::new(config(0.0, 0.0));
        let got = run(&mut net, 42, 1000);
        let mut ids: Vec<u32> = got.iter().map(|&(_, m)| m).collect();
        assert!(
            ids.windows(2).any(|w| w[0] > w[1]),
            "random delays should reorder messages"
        );
        ids.sort();
        assert_eq!(ids, (0..1000).collect::<Vec<_>>());
        let stats = net.stats();
        assert_eq!(
            (
                stats.sent,
                stats.delivered,
                stats.dropped(),
                stats.in_flight()
            ),
            (1000, 1000, 0, 0)
        );
    }

    #[test]
    fn duplication_and_drop_are_applied_and_counted() {
        let mut net = Network::new(config(0.0, 1.0));
        assert_eq!(run(&mut net, 1, 100).len(), 200);
        assert_eq!(net.stats().duplicated, 100);

        let mut net = Network::new(config(0.3, 0.0));
        let got = run(&mut net, 1, 1000).len() as u64;
        let stats = net.stats();
        assert!(
            (200..400).contains(&stats.dropped_random),
            "about 30% dropped: {stats:?}"
        );
        assert_eq!(got + stats.dropped_random, 1000);
    }

    #[test]
    fn partition_drops_only_cut_directions_until_healed() {
        let mut net: Network<u32> = Network::new(config(0.0, 0.0));
        net.cut(0, 1);
        assert!(net.is_cut(0, 1) && !net.is_cut(1, 0));
        assert!(run(&mut net, 1, 10).is_empty());
        assert_eq!(net.stats().dropped_cut, 10);

        net.heal_all();
        net.isolate(1);
        assert!(net.is_cut(0, 1) && net.is_cut(1, 7) && !net.is_cut(1, 1) && !net.is_cut(0, 2));
        net.heal_all();
        net.cut_both(0, 1);
        assert!(net.is_cut(0, 1) && net.is_cut(1, 0));
        net.heal_all();
        assert_eq!(run(&mut net, 1, 10).len(), 10);
    }

    #[test]
    fn down_node_receives_nothing_even_if_it_went_down_in_flight() {
        let mut net: Network<u32> = Network::new(config(0.0, 0.0));
        let mut rng = SimRng::new(5);
        let mut queue: EventQueue<Delivery<u32>> = EventQueue::new(16);
        net.send(&mut rng, &mut queue, 0, 0, 1, 7).unwrap();
        net.set_down(1, true);
        let (_, d) = queue.pop().unwrap();
        assert_eq!(net.receive(d), None);
        net.send(&mut rng, &mut queue, 0, 1, 0, 8).unwrap(); // a down node sends nothing
        assert!(queue.is_empty());
        assert_eq!(net.stats().dropped_down, 2);
        net.set_down(1, false);
        assert_eq!(run(&mut net, 5, 3).len(), 3);
    }

    #[test]
    fn paused_node_gets_its_messages_in_order_on_resume() {
        let mut net: Network<u32> = Network::new(config(0.0, 0.0));
        let mut rng = SimRng::new(3);
        let mut queue: EventQueue<Delivery<u32>> = EventQueue::new(64);
        net.pause(1);
        for i in 0..10 {
            net.send(&mut rng, &mut queue, i, 0, 1, i as u32).unwrap();
        }
        let mut arrival = Vec::new();
        while let Some((_, d)) = queue.pop() {
            arrival.push(d.msg);
            assert_eq!(net.receive(d), None, "held while paused");
        }
        assert!(net.is_paused(1));
        assert_eq!((net.stats().held, net.stats().in_flight()), (10, 10));
        let got: Vec<u32> = net.resume(1).into_iter().map(|d| d.msg).collect();
        assert_eq!(got, arrival, "handed over in arrival order");
        assert!(!net.is_paused(1) && net.resume(1).is_empty());
        assert_eq!((net.stats().delivered, net.stats().in_flight()), (10, 0));
        // Messages from the paused node's peers to others are unaffected.
        net.pause(1);
        let now = queue.now();
        net.send(&mut rng, &mut queue, now, 0, 2, 99).unwrap();
        let (_, d) = queue.pop().unwrap();
        assert_eq!(net.receive(d).map(|d| d.msg), Some(99));
    }

    #[test]
    #[should_panic(expected = "while paused")]
    fn a_paused_node_cannot_send() {
        let mut net: Network<u32> = Network::new(config(0.0, 0.0));
        let mut queue: EventQueue<Delivery<u32>> = EventQueue::new(4);
        net.pause(0);
        let _ = net.send(&mut SimRng::new(1), &mut queue, 0, 0, 1, 1);
    }

    #[test]
    fn same_seed_same_delivery_order() {
        let lossy = config(0.2, 0.2);
        let a = run(&mut Network::new(lossy), 9, 300);
        assert_eq!(a, run(&mut Network::new(lossy), 9, 300));
        assert_ne!(a, run(&mut Network::new(lossy), 10, 300));
    }
}
