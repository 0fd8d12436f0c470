//! Reclaiming a log peer's memory (blocking, std-only): the controller re-places every file of
//! the peer, then a *mover* opens each moved file at a new epoch over its new set, recovers it
//! from a majority of the old set, bases it on the new set (the new member gets the image in
//! the background) and reports the Base to the controller, which ends the move. An application
//! writer it fenced resumes at a newer epoch on its own (`CtlRequest::Resume`) and may finish
//! the move first; the mover then has nothing left to do. The reclaimed peer frees a file when
//! its heartbeat learns that no placement names it any more, and returns its region once empty.

use std::collections::HashMap;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::driver::blocking;
use crate::core::file_client::{ClientConfig, Failure, FileClient, Input};
use crate::proto::{CtlReply, CtlRequest, FileGrant, PeerId, PeerReply, MAX_FRAME_BYTES};

/// One controller request over a fresh authenticated connection.
pub fn ctl_call(controller: &str, secret: &[u8], req: &CtlRequest) -> Result<CtlReply, String> {
    let mut s = blocking::connect_any(controller, secret, Duration::from_secs(5)).map_err(|e| format!("controller {controller}: {e}"))?;
    let rep: CtlReply = blocking::call(&mut s, req, MAX_FRAME_BYTES).map_err(|e| format!("controller {controller}: {e}"))?;
    match rep {
        CtlReply::Error(e) => Err(format!("controller refused {}: {e}", req_name(req))),
        rep => Ok(rep),
    }
}

fn req_name(req: &CtlRequest) -> String {
    let d = format!("{req:?}");
    d.chars().take(120).collect()
}

/// Drives one [`FileClient`] over blocking, authenticated peer connections.
pub struct Driver {
    secret: Vec<u8>,
    peers: HashMap<PeerId, (String, Option<blocking::Conn>, Instant)>,
    start: Instant,
}

impl Driver {
    pub fn new(secret: &[u8]) -> Driver {
        Driver { secret: secret.to_vec(), peers: HashMap::new(), start: Instant::now() }
    }

    pub fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    /// Learns the addresses of a grant's peers (current and recovery set).
    pub fn learn(&mut self, g: &FileGrant) {
        for p in g.peers.iter().chain(&g.recover_from) {
            let e = self.peers.entry(p.id).or_insert_with(|| (p.addr.clone(), None, Instant::now() - Duration::from_secs(1)));
            if e.0 != p.addr {
                *e = (p.addr.clone(), None, Instant::now() - Duration::from_secs(1));
            }
        }
    }

    fn conn(&mut self, peer: PeerId) -> Option<&mut blocking::Conn> {
        let (addr, conn, last_try) = self.peers.get_mut(&peer)?;
        if conn.is_none() && last_try.elapsed() >= Duration::from_millis(200) {
            *last_try = Instant::now();
            if let Ok(s) = blocking::connect(addr, &self.secret, Duration::from_secs(2)) {
                *conn = Some(s);
            }
        }
        conn.as_mut()
    }

    /// Sends the client's outgoing messages (one write per peer), reads replies for up to `wait`.
    pub fn pump(&mut self, c: &mut FileClient, wait: Duration) {
        c.handle(Input::Tick { now_us: self.now_us() });
        let mut batches: HashMap<PeerId, Vec<u8>> = HashMap::new();
        for (p, req) in c.take_outputs() {
            if let Ok(f) = blocking::encode(&req) {
                batches.entry(p).or_default().extend_from_slice(&f);
            }
        }
        for (p, buf) in batches {
            if let Some(conn) = self.conn(p) {
                if conn.write_all(&buf).is_err() {
                    self.peers.get_mut(&p).unwrap().1 = None;
                }
            }
        }
        let ids: Vec<PeerId> = self.peers.iter().filter(|(_, v)| v.1.is_some()).map(|(k, _)| *k).collect();
        if ids.is_empty() {
            std::thread::sleep(wait);
            return;
        }
        let mut fds: Vec<libc::pollfd> = ids.iter().map(|p| libc::pollfd { fd: self.peers[p].1.as_ref().unwrap().as_raw_fd(), events: libc::POLLIN, revents: 0 }).collect();
        // SAFETY: `fds` is a valid pollfd array for the duration of the call.
        if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait.as_millis() as i32) } <= 0 {
            return;
        }
        for (i, p) in ids.iter().enumerate() {
            if fds[i].revents == 0 {
                continue;
            }
            loop {
                let conn = self.peers.get_mut(p).unwrap().1.as_mut().unwrap();
                match blocking::recv::<PeerReply>(conn, MAX_FRAME_BYTES) {
                    Ok(rep) => c.handle(Input::Reply { peer: *p, reply: rep }),
                    Err(_) => {
                        self.peers.get_mut(p).unwrap().1 = None;
                        break;
                    }
                }
                let conn = self.peers.get_mut(p).unwrap().1.as_mut().unwrap();
                let mut pf = libc::pollfd { fd: conn.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // Replies a TLS session decrypted already do not show to poll.
                // SAFETY: one valid pollfd.
                if conn.buffered_plaintext() == 0 && unsafe { libc::poll(&mut pf, 1, 0) } <= 0 {
                    break;
                }
            }
        }
    }

    /// Pumps until `done`, a failure of the client, or the deadline.
    pub fn run(&mut self, c: &mut FileClient, deadline: Instant, done: impl Fn(&FileClient) -> bool) -> Result<(), Failure> {
        loop {
            if let Some(f) = c.failure() {
                return Err(f.clone());
            }
            if done(c) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Failure::NoMajority);
            }
            self.pump(c, Duration::from_millis(5));
        }
    }
}

/// How a file's move ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Moved {
    /// This mover based the new set and the controller recorded it.
    Moved,
    /// Someone else (the writer resuming) completed it, or there was nothing to move.
    AlreadyDone,
    /// The file was removed meanwhile.
    Gone,
}

/// Moves one file with a pending move onto its new set (see the module doc).
pub fn move_file(controller: &str, secret: &[u8], key: &str, deadline: Instant) -> Result<Moved, String> {
    let mut d = Driver::new(secret);
    loop {
        let CtlReply::Status(st) = ctl_call(controller, secret, &CtlRequest::Status)? else { return Err("bad status reply".into()) };
        match st.files.get(key) {
            None => return Ok(Moved::Gone),
            Some(m) if m.prev_peers.is_empty() => return Ok(Moved::AlreadyDone),
            Some(_) => {}
        }
        if Instant::now() >= deadline {
            return Err(format!("moving {key}: no majority of its old peers answered in time"));
        }
        let g = match ctl_call(controller, secret, &CtlRequest::Move { key: key.to_string() }) {
            Ok(CtlReply::Granted(g)) => g,
            Ok(other) => return Err(format!("moving {key}: unexpected answer {other:?}")),
            // Raced with the end of the move or a removal: look again.
            Err(_) => continue,
        };
        d.learn(&g);
        let ids = |v: &[crate::proto::PeerAddr]| v.iter().map(|p| p.id).collect::<Vec<_>>();
        let mut c = FileClient::open_moving(g.file, g.epoch, ids(&g.peers), ids(&g.recover_from), g.initialized, Vec::new(), ClientConfig::default(), d.now_us());
        match d.run(&mut c, deadline, |c| c.is_ready()) {
            Ok(()) => {}
            Err(Failure::Fenced { .. }) => {
                // The writer resumed (or another open): it bases the new set itself. Give it
                // time (until the move is done or the epoch stops changing) before trying again.
                wait_quiet(controller, secret, key, deadline)?;
                continue;
            }
            Err(e) => return Err(format!("moving {key} (epoch {}): {e}", g.epoch)),
        }
        if let Err(e) = ctl_call(controller, secret, &CtlRequest::Initialized { key: key.to_string(), epoch: g.epoch }) {
            // A newer epoch exists: that opener finishes the move.
            tracing_note(&format!("moving {key}: {e}"));
            continue;
        }
        // Background catch-up of the new member; a writer fencing us takes this over.
        let _ = d.run(&mut c, deadline, |c| c.fully_replicated());
        return Ok(Moved::Moved);
    }
}

/// Waits until `key` has no pending move, or its epoch did not change for `QUIET_MS`.
fn wait_quiet(controller: &str, secret: &[u8], key: &str, deadline: Instant) -> Result<(), String> {
    const QUIET_MS: u64 = 1000;
    let mut last = None;
    let mut since = Instant::now();
    while Instant::now() < deadline {
        let CtlReply::Status(st) = ctl_call(controller, secret, &CtlRequest::Status)? else { return Err("bad status reply".into()) };
        let Some(m) = st.files.get(key) else { return Ok(()) };
        if m.prev_peers.is_empty() {
            return Ok(());
        }
        if last != Some(m.epoch) {
            last = Some(m.epoch);
            since = Instant::now();
        } else if since.elapsed() >= Duration::from_millis(QUIET_MS) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn tracing_note(msg: &str) {
    eprintln!("nearlog mover: {msg}");
}

/// Reclaims `peer`: asks the controller to re-place its files, moves each, then waits until
/// the peer reported (by heartbeat) that it holds nothing. Returns the keys moved.
pub fn reclaim(controller: &str, secret: &[u8], peer: PeerId, deadline: Instant) -> Result<Vec<String>, String> {
    let CtlReply::Reclaiming { pending } = ctl_call(controller, secret, &CtlRequest::Reclaim { peer })? else {
        return Err("unexpected answer to Reclaim".into());
    };
    for key in &pending {
        move_file(controller, secret, key, deadline)?;
    }
    loop {
        let CtlReply::Status(st) = ctl_call(controller, secret, &CtlRequest::Status)? else { return Err("bad status reply".into()) };
        let on_it: Vec<&String> = st.files.iter().filter(|(_, m)| m.peers.contains(&peer) || m.prev_peers.contains(&peer)).map(|(k, _)| k).collect();
        let used = st.peers.get(&peer).map(|p| p.used_bytes).unwrap_or(0);
        if on_it.is_empty() && used == 0 {
            return Ok(pending);
        }
        if Instant::now() >= deadline {
            return Err(format!("peer {peer} still holds {used} bytes; files still placed on it: {on_it:?}"));
        }
        // New files may have been placed before the peer was marked draining: move them too.
        for key in on_it.into_iter().cloned().collect::<Vec<_>>() {
            if st.files[&key].peers.contains(&peer) {
                let _ = ctl_call(controller, secret, &CtlRequest::Reclaim { peer });
            }
            move_file(controller, secret, &key, deadline)?;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
