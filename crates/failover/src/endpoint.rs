//! A re-pointable TCP proxy: the stable client address Understudy owns (the "elastic IP" of
//! §4.3), and — the same code — each instance's network link, which a fault can cut.
//!
//! [`Proxy::point`] changes the target and **severs every connection made to the old target**:
//! after a promotion the old primary can no longer answer a client from its caches, because no
//! client path to it is left. Pointing at `None` refuses new connections (and severs the old
//! ones): a cut network link.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

/// Connections one proxy carries at most; more wait in the listen backlog.
pub const MAX_CONNECTIONS: usize = 1024;
/// How long connecting to the target may take before the client's connection is dropped.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

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

async fn accept_loop(listener: TcpListener, rx: watch::Receiver<Target>, severed: Arc<AtomicU64>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let (client, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("proxy accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let mut rx = rx.clone();
        let severed = severed.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let mut t = *rx.borrow_and_update();
            if t.hold {
                // Frozen: wait for the next target rather than refuse (a failover in progress).
                let thawed = tokio::time::timeout(HOLD_TIMEOUT, async {
                    while rx.changed().await.is_ok() {
                        let now = *rx.borrow_and_update();
                        if !now.hold {
                            return Some(now);
                        }
                    }
                    None
                })
                .await;
                match thawed {
                    Ok(Some(now)) => t = now,
                    _ => return,
                }
            }
            let Some(addr) = t.addr else { return };
            let upstream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
                Ok(Ok(s)) => s,
                _ => return,
            };
            let _ = client.set_nodelay(true);
            let _ = upstream.set_nodelay(true);
            let (mut client, mut upstream) = (client, upstream);
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
                    // A zero linger sends RST at once; it never blocks.
                    #[allow(deprecated)]
                    let _ = client.set_linger(Some(Duration::ZERO));
                    #[allow(deprecated)]
                    let _ = upstream.set_linger(Some(Duration::ZERO));
                }
            }
            let _ = client.shutdown().await;
        });
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
