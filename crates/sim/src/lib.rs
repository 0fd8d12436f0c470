//! Deterministic simulation for Understudy's sans-I/O protocol cores.
//!
//! Not a paper section but the test bed for all of them: the simulation driver of
//! `ARCHITECTURE.md` (anchors: TigerBeetle's VOPR, FoundationDB's simulation). A test harness
//! owns an event loop built from these parts and feeds each core its inputs (messages, timer
//! ticks, disk completions). No threads, no real clock, no I/O: a run is a pure function of its
//! `u64` seed, so a failing seed replays the failure exactly.
//!
//! - [`SimRng`]: seeded ChaCha8 randomness; [`SimRng::fork`] gives each component its own stream.
//! - [`EventQueue`] and [`TimeUs`]: virtual time; a bounded queue ordered by (time, insertion).
//! - [`Network`]: drops, duplicates, delays/reorders and partitions messages between [`NodeId`]s,
//!   and holds the messages of a paused node (stopped, not crashed) until it resumes.
//! - [`SimDisk`]: files with a page cache, `sync`/`sync_dir`, and power-loss `crash` that loses
//!   or tears unsynced writes; capacity and injected I/O errors.
//!
//! # Example harness
//!
//! Node 0 pings node 1 for a number of rounds over a lossy network, retrying on a timer; node 1
//! answers each ping. The same seed gives the same trace, event for event.
//!
//! ```
//! use sim::{Delivery, EventQueue, NetConfig, Network, NodeId, SimRng};
//!
//! #[derive(Clone, Debug)]
//! enum Msg { Ping(u32), Pong(u32) }
//!
//! enum Event { Deliver(Delivery<Msg>), RetryTimer(u32) }
//! impl From<Delivery<Msg>> for Event {
//!     fn from(d: Delivery<Msg>) -> Self { Event::Deliver(d) }
//! }
//!
//! const PINGER: NodeId = 0;
//! const PONGER: NodeId = 1;
//! const ROUNDS: u32 = 20;
//! const RETRY_INTERVAL_US: u64 = 5_000;
//!
//! fn run(seed: u64) -> Vec<String> {
//!     let mut rng = SimRng::new(seed);
//!     let mut net_rng = rng.fork();
//!     let mut net = Network::new(NetConfig {
//!         drop_probability: 0.2,
//!         duplicate_probability: 0.1,
//!         delay_us_min: 100,
//!         delay_us_max: 2_000,
//!     });
//!     let mut queue = EventQueue::new(1_000);
//!     let mut trace = Vec::new();
//!     let mut rounds_done = 0; // the pinger's whole state
//!
//!     net.send(&mut net_rng, &mut queue, 0, PINGER, PONGER, Msg::Ping(0)).unwrap();
//!     queue.push_after(0, RETRY_INTERVAL_US, Event::RetryTimer(0)).unwrap();
//!     while let Some((now, event)) = queue.pop() {
//!         match event {
//!             Event::Deliver(d) => {
//!                 let Some(d) = net.receive(d) else { continue };
//!                 trace.push(format!("{now} {}->{} {:?}", d.from, d.to, d.msg));
//!                 match d.msg {
//!                     Msg::Ping(n) => {
//!                         net.send(&mut net_rng, &mut queue, now, PONGER, PINGER, Msg::Pong(n)).unwrap()
//!                     }
//!                     Msg::Pong(n) if n == rounds_done => {
//!                         rounds_done += 1;
//!                         if rounds_done < ROUNDS {
//!                             let ping = Msg::Ping(rounds_done);
//!                             net.send(&mut net_rng, &mut queue, now, PINGER, PONGER, ping).unwrap();
//!                             queue.push_after(now, RETRY_INTERVAL_US, Event::RetryTimer(rounds_done)).unwrap();
//!                         }
//!                     }
//!                     Msg::Pong(_) => {} // duplicate or stale
//!                 }
//!             }
//!             Event::RetryTimer(n) if n == rounds_done => {
//!                 trace.push(format!("{now} retry {n}"));
//!                 net.send(&mut net_rng, &mut queue, now, PINGER, PONGER, Msg::Ping(n)).unwrap();
//!                 queue.push_after(now, RETRY_INTERVAL_US, Event::RetryTimer(n)).unwrap();
//!             }
//!             Event::RetryTimer(_) => {} // that round already finished
//!         }
//!     }
//!     assert_eq!(rounds_done, ROUNDS);
//!     assert_eq!(net.stats().in_flight(), 0);
//!     trace
//! }
//!
//! assert_eq!(run(1), run(1));
//! assert_ne!(run(1), run(2));
//! assert!(run(1).iter().any(|line| line.contains("retry")), "drops force retries");
//! ```

mod disk;
mod net;
mod rng;
mod time;

pub use disk::{DiskError, SimDisk, DEFAULT_CAPACITY_BYTES, SECTOR_BYTES};
pub use net::{Delivery, NetConfig, NetStats, Network, NodeId};
pub use rng::SimRng;
pub use time::{EventQueue, QueueFull, TimeUs};
