//! A re-pointable TCP proxy: the stable client address Understudy owns (the "elastic IP" of
//! §4.3), and — the same code — each instance's network link, which a fault can cut.
//!
//! [`Proxy::point`] changes the target and **severs every connection made to the old target**:
//! after a promotion the old primary can no longer answer a client from its caches, because no
//! client path to it is left. Pointing at `None` refuses new connections (and severs the old
//! ones): a cut network link. A client connection that is still being connected to the target
//! follows a re-point at once (nothing of it reached the old target yet); one the target
//! refuses is reset at once, so the client retries rather than waits out a timeout.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Connections one proxy carries at most (also at most half the process's connection limit:
/// each takes two descriptors, the client's and the target's); more are closed at once.
pub const MAX_CONNECTIONS: usize = 1024;
/// How long the proxy keeps trying to reach an unresponsive target (packets dropped: a cut
/// link) before it resets the client's connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// One connection attempt to the target: a live target on this machine answers a SYN within
/// microseconds, so an unanswered one is retried this often (a link that heals is used at
/// once, not after the kernel's SYN back-off of 1 s, 3 s, ...).
pub const CONNECT_ATTEMPT: Duration = Duration::from_millis(250);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Target {
    generation: u64,
    addr: Option<SocketAddr>,
    /// Frozen: new connections wait (up to [`HOLD_TIMEOUT`]) for the next target.
    hold: bool,
}

/// How long a connection accepted while the endpoint is frozen waits for a target before it is
/// closed.
pub const HOLD_TIMEOUT: Duration = Duration::from_secs(30);

pub struct Proxy {
    local: SocketAddr,
    target: watch::Sender<Target>,
    severed: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on `listen` (port 0: any free port), initially pointing at `target`.
    pub async fn bind(listen: SocketAddr, target: Option<SocketAddr>) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind(listen).await?;
        let local = listener.local_addr()?;
        let (tx, rx) = watch::channel(Target { generation: 0, addr: target, hold: false });
        let severed = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(accept_loop(listener, rx, severed.clone()));
        Ok(Proxy { local, target: tx, severed, task })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    pub fn target(&self) -> Option<SocketAddr> {
        self.target.borrow().addr
    }

    /// Re-points the proxy and severs every connection to the previous target (also when the
    /// target is unchanged: a re-point is a fence).
    pub fn point(&self, addr: Option<SocketAddr>) {
        self.target.send_modify(|t| {
            t.generation += 1;
            t.hold = false;
            t.addr = addr;
        });
    }

    /// Stops forwarding: severs every open connection and holds new ones (they wait up to
    /// [`HOLD_TIMEOUT`] for the next [`Proxy::point`], then go to that target). Used before a
    /// collapse: whichever way it goes, no client reaches the old primary in between.
    pub fn freeze(&self) {
        self.target.send_modify(|t| {
            t.generation += 1;
            t.hold = true;
            t.addr = None;
        });
    }

    pub fn frozen(&self) -> bool {
        self.target.borrow().hold
    }

    /// Connections cut by [`Proxy::point`] so far.
    pub fn severed(&self) -> u64 {
        self.severed.load(Ordering::Relaxed)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        // Sever whatever is still open.
        self.point(None);
    }
}

fn proxy_limit() -> wire::listen::ConnLimit {
    wire::listen::ConnLimit::new(MAX_CONNECTIONS.min(wire::listen::ConnLimit::process().max() / 2))
}

async fn accept_loop(listener: TcpListener, rx: watch::Receiver<Target>, severed: Arc<AtomicU64>) {
    // Accept errors are waited out with backoff; connections over the limit are closed at once.
    let listener = wire::listen::Listener::new(listener, "failover endpoint", proxy_limit());
    loop {
        let admitted = listener.accept().await;
        let (client, permit) = (admitted.stream, admitted.permit);
        let mut rx = rx.clone();
        let severed = severed.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let mut client = client;
            let mut early = Vec::new();
            let (mut upstream, t) = match connect_upstream(&mut rx, &mut client, &mut early).await {
                Ok(u) => u,
                Err(Gone::Refused) => {
                    reset(&client);
                    return;
                }
                Err(Gone::ClientLeft) => return,
            };
            let _ = client.set_nodelay(true);
            let _ = upstream.set_nodelay(true);
            // What the client sent while it waited goes first.
            if upstream.write_all(&early).await.is_err() {
                reset(&client);
                return;
            }
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
                _ = async {
                    while rx.changed().await.is_ok() {
                        if rx.borrow().generation != t.generation {
                            return;
                        }
                    }
                } => {
                    severed.fetch_add(1, Ordering::Relaxed);
                    // Reset rather than close: the client must not take it for a clean end.
                    reset(&client);
                    reset(&upstream);
                }
            }
            let _ = client.shutdown().await;
        });
    }
}

/// A zero linger: closing sends RST at once (never blocks), so the peer sees an error, not a
/// clean end.
fn reset(s: &TcpStream) {
    #[allow(deprecated)]
    let _ = s.set_linger(Some(Duration::ZERO));
}

/// Bytes a client may send before its connection reaches a target (a request or two); past
/// this the proxy stops reading it until then.
pub const MAX_EARLY_BYTES: usize = 64 << 10;

/// Why a client connection gets no target.
enum Gone {
    /// No target, refused, unreachable, or no answer in time: reset the client.
    Refused,
    /// The client closed its connection while it waited (it gave up on its request): its bytes
    /// are dropped, not sent to the next target.
    ClientLeft,
}

/// Reads what the client sends while it waits (up to [`MAX_EARLY_BYTES`]) into `early`;
/// resolves only when the client closes or fails.
async fn client_leaves(client: &mut TcpStream, early: &mut Vec<u8>) {
    let mut buf = [0u8; 4096];
    loop {
        if early.len() >= MAX_EARLY_BYTES {
            return std::future::pending().await;
        }
        let room = (MAX_EARLY_BYTES - early.len()).min(buf.len());
        match client.read(&mut buf[..room]).await {
            Ok(0) | Err(_) => return,
            Ok(n) => early.extend_from_slice(&buf[..n]),
        }
    }
}

/// Connects to the current target, following the endpoint while it does: held while frozen
/// (up to [`HOLD_TIMEOUT`]), re-aimed at once when re-pointed, retried every
/// [`CONNECT_ATTEMPT`] while the target does not answer (up to [`CONNECT_TIMEOUT`]). A client
/// that leaves meanwhile is let go (what it sent never reaches a target).
async fn connect_upstream(rx: &mut watch::Receiver<Target>, client: &mut TcpStream, early: &mut Vec<u8>) -> Result<(TcpStream, Target), Gone> {
    let mut t = *rx.borrow_and_update();
    loop {
        if t.hold {
            // Frozen: wait for the next target rather than refuse (a failover in progress).
            let thawed = async {
                while rx.changed().await.is_ok() {
                    let now = *rx.borrow_and_update();
                    if !now.hold {
                        return Some(now);
                    }
                }
                None
            };
            t = tokio::select! {
                r = tokio::time::timeout(HOLD_TIMEOUT, thawed) => r.ok().flatten().ok_or(Gone::Refused)?,
                _ = client_leaves(client, early) => return Err(Gone::ClientLeft),
            };
        }
        let addr = t.addr.ok_or(Gone::Refused)?;
        let deadline = tokio::time::Instant::now() + CONNECT_TIMEOUT;
        let changed = loop {
            let attempt = tokio::time::timeout(CONNECT_ATTEMPT, TcpStream::connect(addr));
            tokio::select! {
                r = attempt => match r {
                    Ok(Ok(s)) => return Ok((s, t)),
                    // Refused (nothing listens: a crashed application) or unreachable: at once.
                    Ok(Err(_)) => return Err(Gone::Refused),
                    // No answer (packets dropped): try again with a fresh SYN, for a while.
                    Err(_) if tokio::time::Instant::now() >= deadline => return Err(Gone::Refused),
                    Err(_) => {}
                },
                c = rx.changed() => {
                    c.map_err(|_| Gone::Refused)?;
                    let now = *rx.borrow_and_update();
                    if now.generation != t.generation {
                        break now;
                    }
                }
                _ = client_leaves(client, early) => return Err(Gone::ClientLeft),
            }
        };
        t = changed;
    }
}

/// How often an endpoint that follows the control store ([`follow`]) reads the primary's
/// record: the delay between a monitor's re-point (or freeze) and the endpoint acting on it.
pub const FOLLOW_INTERVAL_MS: u64 = 50;
/// Between two warnings about an unreachable store, at least (one per read would flood the log).
const FOLLOW_WARN_EVERY: Duration = Duration::from_secs(5);

/// Makes `proxy` follow the primary record of application `name` that the leading monitor
/// publishes on the control store (`failover endpoint`): re-pointed (and its connections to the
/// old primary severed) when the record names another instance or address, frozen when the
/// record is. A record naming the instance the proxy already points at changes nothing: a new
/// monitor leader re-publishing the same primary does not cut clients off. While the store is
/// unreachable the proxy keeps its last target (clients keep being served; the monitor cannot
/// fail over meanwhile either, as it cannot write). Until a record is first read, new
/// connections are held. Runs until dropped; `on_change` sees every record acted on.
pub async fn follow(store: control::Store, name: String, proxy: std::sync::Arc<Proxy>, mut on_change: impl FnMut(&crate::proto::PrimaryRecord)) {
    proxy.freeze();
    let mut current: Option<(Option<crate::proto::InstanceId>, Option<SocketAddr>, bool)> = None;
    let mut warned: Option<tokio::time::Instant> = None;
    loop {
        match crate::driver::store::read_primary(&store, &name).await {
            Ok(Some((p, _))) => {
                let now = (p.instance, p.addr, p.frozen);
                if current != Some(now) {
                    if p.frozen {
                        proxy.freeze();
                    } else {
                        proxy.point(p.addr);
                    }
                    current = Some(now);
                    on_change(&p);
                }
            }
            Ok(None) => {}
            Err(e) => {
                if warned.is_none_or(|w| w.elapsed() >= FOLLOW_WARN_EVERY) {
                    tracing::warn!("failover endpoint: cannot read the primary of {name}: {e}; keeping the last target");
                    eprintln!("failover endpoint: cannot read the primary of {name}: {e}; keeping the last target");
                    warned = Some(tokio::time::Instant::now());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(FOLLOW_INTERVAL_MS)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

    async fn echo_server(tag: &'static str) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (s, _) = l.accept().await.unwrap();
                tokio::spawn(async move {
                    let (r, mut w) = s.into_split();
                    let mut lines = BufReader::new(r).lines();
                    while let Ok(Some(l)) = lines.next_line().await {
                        if w.write_all(format!("{tag} {l}\n").as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn ask(s: &mut BufReader<TcpStream>, q: &str) -> Option<String> {
        s.get_mut().write_all(format!("{q}\n").as_bytes()).await.ok()?;
        let mut line = String::new();
        match s.read_line(&mut line).await {
            Ok(n) if n > 0 => Some(line.trim().to_string()),
            _ => None,
        }
    }

    /// More clients than the proxy's limit: the excess is closed at once (not left waiting in
    /// the backlog), the admitted ones are served, and a client after the flood is served.
    #[tokio::test]
    async fn a_flood_past_the_limit_is_refused_early_and_survived() {
        // Both ends of every connection are in this process (up to 4 descriptors each).
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: valid pointers to an rlimit.
        unsafe {
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
        let a = echo_server("a").await;
        let p = Proxy::bind("127.0.0.1:0".parse().unwrap(), Some(a)).await.unwrap();
        let limit = proxy_limit().max();
        let mut flood = Vec::new();
        for _ in 0..limit + 20 {
            flood.push(TcpStream::connect(p.local_addr()).await.unwrap());
        }
        let last = flood.last_mut().unwrap();
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_secs(10), tokio::io::AsyncReadExt::read(last, &mut b)).await;
        assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "a connection past the limit of {limit} was not closed at once: {r:?}");
        let mut first = BufReader::new(flood.remove(0));
        assert_eq!(ask(&mut first, "in").await.as_deref(), Some("a in"));
        drop(flood);
        drop(first);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut c = BufReader::new(TcpStream::connect(p.local_addr()).await.unwrap());
        assert_eq!(ask(&mut c, "after").await.as_deref(), Some("a after"));
    }

    #[tokio::test]
    async fn repoint_severs_old_connections() {
        let a = echo_server("a").await;
        let b = echo_server("b").await;
        let p = Proxy::bind("127.0.0.1:0".parse().unwrap(), Some(a)).await.unwrap();
        let mut c1 = BufReader::new(TcpStream::connect(p.local_addr()).await.unwrap());
        assert_eq!(ask(&mut c1, "x").await.as_deref(), Some("a x"));
        p.point(Some(b));
        // The old connection is gone: no more answers from a through it.
        assert_eq!(ask(&mut c1, "y").await, None);
        let mut c2 = BufReader::new(TcpStream::connect(p.local_addr()).await.unwrap());
        assert_eq!(ask(&mut c2, "z").await.as_deref(), Some("b z"));
        assert_eq!(p.severed(), 1);
        // Cut: new connections are refused (closed at once).
        p.point(None);
        let mut c3 = BufReader::new(TcpStream::connect(p.local_addr()).await.unwrap());
        assert_eq!(ask(&mut c3, "w").await, None);
    }

    /// A connection still being connected when the endpoint is re-pointed follows it: a target
    /// that drops SYNs (here: a listener whose backlog is full) does not hold the client until
    /// the connect times out.
    #[tokio::test]
    async fn a_connect_in_progress_follows_a_re_point() {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let blackhole = sock.listen(0).unwrap();
        let hole = blackhole.local_addr().unwrap();
        // Fill its accept queue (never accepted): further SYNs are dropped.
        let mut fillers = vec![];
        for _ in 0..4 {
            if let Ok(Ok(s)) = tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(hole)).await {
                fillers.push(s);
            }
        }
        let b = echo_server("b").await;
        let p = Proxy::bind("127.0.0.1:0".parse().unwrap(), Some(hole)).await.unwrap();
        let mut c = BufReader::new(TcpStream::connect(p.local_addr()).await.unwrap());
        c.get_mut().write_all(b"x\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        p.point(Some(b));
        let mut line = String::new();
        tokio::time::timeout(Duration::from_secs(10), c.read_line(&mut line)).await.unwrap().unwrap();
        assert_eq!(line.trim(), "b x", "the held connection reached the new target");
        drop(fillers);
    }

    /// An endpoint following the store: held until a record exists, pointed at the published
    /// primary, frozen when told, re-pointed (severing) at a new primary; the same primary
    /// re-published by a new leader leaves open connections alone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn following_the_store_points_freezes_and_ignores_a_re_publication() {
        use crate::proto::{InstanceId, PrimaryRecord};
        let dir = tempfile::tempdir().unwrap();
        let store = control::Store::open(dir.path().to_str().unwrap(), "t", "id").await.unwrap();
        let key = crate::driver::store::primary_key(&store, "db");
        let put = |p: PrimaryRecord| {
            let (store, key) = (store.clone(), key.clone());
            async move { store.put(&key, serde_json::to_vec(&p).unwrap()).await.unwrap() }
        };
        let (a, b) = (echo_server("a").await, echo_server("b").await);
        let p = std::sync::Arc::new(Proxy::bind("127.0.0.1:0".parse().unwrap(), None).await.unwrap());
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let s2 = seen.clone();
        let task = tokio::spawn(follow(store.clone(), "db".into(), p.clone(), move |r| s2.lock().unwrap().push(r.clone())));
        let settle = || tokio::time::sleep(Duration::from_millis(10 * FOLLOW_INTERVAL_MS));
        settle().await;
        assert!(p.frozen(), "held until a primary is published");
        put(PrimaryRecord { instance: Some(InstanceId(1)), addr: Some(a), frozen: false, writer: 3 }).await;
        settle().await;
        let mut c1 = BufReader::new(TcpStream::connect(p.local_addr()).await.unwrap());
        assert_eq!(ask(&mut c1, "x").await.as_deref(), Some("a x"));
        // A new leader publishes the same primary: nothing is cut.
        put(PrimaryRecord { instance: Some(InstanceId(1)), addr: Some(a), frozen: false, writer: 8 }).await;
        settle().await;
        assert_eq!(ask(&mut c1, "y").await.as_deref(), Some("a y"));
        assert_eq!(p.severed(), 0);
        // Frozen: the open connection is cut, a new one held; then the backup.
        put(PrimaryRecord { instance: None, addr: None, frozen: true, writer: 8 }).await;
        settle().await;
        assert!(p.frozen());
        assert_eq!(ask(&mut c1, "z").await, None);
        put(PrimaryRecord { instance: Some(InstanceId(2)), addr: Some(b), frozen: false, writer: 8 }).await;
        settle().await;
        let mut c2 = BufReader::new(TcpStream::connect(p.local_addr()).await.unwrap());
        assert_eq!(ask(&mut c2, "w").await.as_deref(), Some("b w"));
        assert_eq!(seen.lock().unwrap().len(), 3, "acted on three records (the re-publication changed nothing)");
        task.abort();
    }

    #[tokio::test]
    async fn freeze_severs_and_holds_until_the_next_target() {
        let a = echo_server("a").await;
        let b = echo_server("b").await;
        let p = Proxy::bind("127.0.0.1:0".parse().unwrap(), Some(a)).await.unwrap();
        let mut c1 = BufReader::new(TcpStream::connect(p.local_addr()).await.unwrap());
        assert_eq!(ask(&mut c1, "x").await.as_deref(), Some("a x"));
        p.freeze();
        assert!(p.frozen());
        // The open connection to the old target answers no more.
        assert_eq!(ask(&mut c1, "y").await, None);
        // A new one is held: no answer while frozen (from a or anyone) ...
        let mut c2 = BufReader::new(TcpStream::connect(p.local_addr()).await.unwrap());
        c2.get_mut().write_all(b"z\n").await.unwrap();
        let mut line = String::new();
        let early = tokio::time::timeout(Duration::from_millis(300), c2.read_line(&mut line)).await;
        assert!(early.is_err(), "answered while frozen: {line:?}");
        // ... and reaches the next target once there is one.
        p.point(Some(b));
        tokio::time::timeout(Duration::from_secs(5), c2.read_line(&mut line)).await.unwrap().unwrap();
        assert_eq!(line.trim(), "b z");
    }
}
