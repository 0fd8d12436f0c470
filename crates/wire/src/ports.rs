//! Free loopback ports for a process that another one starts: a local cluster's daemons, a
//! benchmark's monitors, a test's servers. The starter learns a port here and the child binds it
//! later, so another process can take the port in between. Ports are picked below the kernel's
//! ephemeral range (`net.ipv4.ip_local_port_range`), which the kernel never hands out on its
//! own — not as the source port of another process's outgoing connection, nor for a bind of
//! port 0 — so only another process that also picks explicit ports can race for one (a port
//! from `bind(:0)` was taken by an unrelated connection once in a full test run).

use std::io;
use std::net::TcpListener;

/// The lowest port picked (below it live well-known and registered services' defaults).
const FIRST_PICKED_PORT: u16 = 20_000;
/// Tries per port before giving up (a try fails only if the port is in use).
const TRIES_PER_PORT: usize = 200;

/// `n` distinct loopback TCP ports that were free a moment ago, below the ephemeral range (or
/// from it, through `bind(:0)`, where that range leaves no room below it).
pub fn free_loopback_ports(n: usize) -> io::Result<Vec<u16>> {
    let below = ephemeral_range_start().filter(|&start| start >= FIRST_PICKED_PORT + 1000);
    // Every chosen port stays bound until all are chosen, so they are distinct.
    let mut held: Vec<TcpListener> = Vec::with_capacity(n);
    for _ in 0..n {
        let listener = match below {
            Some(end) => pick_below(end)?,
            None => TcpListener::bind("127.0.0.1:0")?,
        };
        held.push(listener);
    }
    held.iter().map(|l| Ok(l.local_addr()?.port())).collect()
}

/// One loopback TCP port that was free a moment ago (see [`free_loopback_ports`]).
pub fn free_loopback_port() -> io::Result<u16> {
    Ok(free_loopback_ports(1)?[0])
}

fn pick_below(end: u16) -> io::Result<TcpListener> {
    let mut last = io::Error::new(io::ErrorKind::AddrInUse, "no free port");
    for _ in 0..TRIES_PER_PORT {
        let port = rand::Rng::gen_range(&mut rand::thread_rng(), FIRST_PICKED_PORT..end);
        match TcpListener::bind(("127.0.0.1", port)) {
            Ok(l) => return Ok(l),
            Err(e) => last = e,
        }
    }
    Err(io::Error::new(last.kind(), format!("no free loopback port in {FIRST_PICKED_PORT}..{end} after {TRIES_PER_PORT} tries: {last}")))
}

/// The first port of the kernel's ephemeral range, if it can be read.
fn ephemeral_range_start() -> Option<u16> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_free_and_outside_the_ephemeral_range() {
        let ports = free_loopback_ports(64).unwrap();
        let mut sorted = ports.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), ports.len(), "{ports:?}");
        if let Some(start) = ephemeral_range_start().filter(|&s| s >= FIRST_PICKED_PORT + 1000) {
            assert!(ports.iter().all(|&p| (FIRST_PICKED_PORT..start).contains(&p)), "{ports:?} not below {start}");
        }
        // Free: each can be bound now.
        let _held: Vec<TcpListener> = ports.iter().map(|&p| TcpListener::bind(("127.0.0.1", p)).unwrap()).collect();
    }
}
