//! Scaffolding shared by the nearlog simulator tests (`sim_*.rs`): the message and event types
//! of the simulated network, a network with or without loss, sending a client's output over it,
//! and the seeds to run (`SIM_SEEDS=N` runs N seeds, `SIM_SEED=S` only S).
#![allow(dead_code)]

use nearlog::core::file_client::FileClient;
use nearlog::proto::{PeerReply, PeerRequest};
use sim::{Delivery, EventQueue, NetConfig, Network, NodeId, SimRng};

#[derive(Clone, Debug)]
pub enum Msg {
    Req(PeerRequest),
    Rep(PeerReply),
}

/// A simulation's events: deliveries, the clients' clock, and the test's own faults `F`.
pub enum Ev<F> {
    Deliver(Delivery<Msg>),
    Tick,
    Fault(F),
}

impl<F> From<Delivery<Msg>> for Ev<F> {
    fn from(d: Delivery<Msg>) -> Self {
        Ev::Deliver(d)
    }
}

/// A network that, with probability `lossy_chance`, drops and duplicates `loss` of the messages;
/// delays between 50 µs and `delay_us_max` (so it reorders).
pub fn network(rng: &mut SimRng, lossy_chance: f64, loss: f64, delay_us_max: u64) -> Network<Msg> {
    let lossy = rng.chance(lossy_chance);
    Network::new(NetConfig {
        drop_probability: if lossy { loss } else { 0.0 },
        duplicate_probability: if lossy { loss } else { 0.0 },
        delay_us_min: 50,
        delay_us_max,
    })
}

/// Sends everything `c` has to say from node `from` (peer `p` is node `p`).
pub fn send_out<F>(c: &mut FileClient, from: NodeId, net: &mut Network<Msg>, net_rng: &mut SimRng, q: &mut EventQueue<Ev<F>>, now: u64) {
    for (p, req) in c.take_outputs() {
        net.send(net_rng, q, now, from, p as NodeId, Msg::Req(req)).unwrap();
    }
}

/// The seeds to run: `SIM_SEED=S` alone (and true: report it), else `0..SIM_SEEDS` (default
/// `default`).
pub fn seeds(default: u64) -> (Vec<u64>, bool) {
    if let Ok(s) = std::env::var("SIM_SEED") {
        return (vec![s.parse().expect("SIM_SEED is a number")], true);
    }
    let n: u64 = std::env::var("SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    ((0..n).collect(), false)
}

/// `SIM_TRACE` set: the tests print what happens.
pub fn trace() -> bool {
    std::env::var("SIM_TRACE").is_ok()
}
