//! Accepting connections: the one accept loop every listener of every daemon goes through.
//!
//! A listener must outlive whatever a client does to it. Three things made a flood of plain TCP
//! connections (no secret needed) take daemons down, and each has its mechanism here:
//!
//! * **accept errors** (`EMFILE`/`ENFILE` when out of descriptors, `ENOBUFS`/`ENOMEM`, or a
//!   connection aborted before it was accepted) are logged and survived: [`accept`] never
//!   returns an error. Resource errors back off ([`BACKOFF_MIN_MS`] doubling to
//!   [`BACKOFF_MAX_MS`]) instead of retrying at once — the pending connection stays in the
//!   backlog, so an immediate retry fails again and spins a core — and are logged once per
//!   burst, with a count when the burst ends.
//! * **a connection limit** per daemon ([`ConnLimit`], shared by all its listeners): a
//!   connection beyond it is accepted and closed at once (a rate-limited log line says so), so
//!   connections can never take the descriptors the daemon needs for its own files and links.
//!   Configured by `UNDERSTUDY_MAX_CONNECTIONS` (default [`DEFAULT_MAX_CONNECTIONS`]) and
//!   capped at [`FD_SHARE_FOR_CONNECTIONS`] of the process's descriptor limit.
//! * **an authentication deadline**: [`crate::auth::accept`] fails after [`AUTH_DEADLINE`], so
//!   a connection that never authenticates holds its slot that long at most.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Connections a daemon serves at once unless `UNDERSTUDY_MAX_CONNECTIONS` says otherwise:
/// below the usual descriptor limit of 1024, leaving the rest for the daemon's own files.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;
/// Environment variable setting a daemon's connection limit (a positive integer).
pub const MAX_CONNECTIONS_ENV: &str = "UNDERSTUDY_MAX_CONNECTIONS";
/// Share of the soft RLIMIT_NOFILE that connections may take (the limit is capped to it): the
/// rest is the daemon's own (data files, logs, outgoing links, the runtime's descriptors).
pub const FD_SHARE_FOR_CONNECTIONS: f64 = 0.5;
/// Time a client has to complete the authentication handshake on any port.
pub const AUTH_DEADLINE: Duration = Duration::from_secs(5);
/// First pause after an accept error caused by a lack of resources.
pub const BACKOFF_MIN_MS: u64 = 10;
/// Longest pause between accept attempts while resources lack.
pub const BACKOFF_MAX_MS: u64 = 100;
/// At most one "refused: over the limit" log line per listener per this interval.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(5);

/// The connection limit of a daemon, shared by all its listeners.
#[derive(Clone, Debug)]
pub struct ConnLimit {
    slots: Arc<Semaphore>,
    max: usize,
}

impl ConnLimit {
    /// A limit of `max` connections (at least 1).
    pub fn new(max: usize) -> ConnLimit {
        let max = max.max(1);
        ConnLimit { slots: Arc::new(Semaphore::new(max)), max }
    }

    /// The limit of this process: `UNDERSTUDY_MAX_CONNECTIONS` or the default, capped to its
    /// share of the descriptor limit; one for the whole process, so every listener of a daemon
    /// shares it.
    pub fn process() -> ConnLimit {
        static LIMIT: OnceLock<ConnLimit> = OnceLock::new();
        LIMIT.get_or_init(|| ConnLimit::new(configured_max_connections())).clone()
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Connections being served now.
    pub fn in_use(&self) -> usize {
        self.max - self.slots.available_permits()
    }

    fn try_admit(&self) -> Option<OwnedSemaphorePermit> {
        self.slots.clone().try_acquire_owned().ok()
    }
}

/// The process's connection limit as configured, capped by its descriptor limit.
fn configured_max_connections() -> usize {
    let wanted = match std::env::var(MAX_CONNECTIONS_ENV) {
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => {
                tracing::warn!("{MAX_CONNECTIONS_ENV}={v:?} is not a positive integer; using {DEFAULT_MAX_CONNECTIONS}");
                DEFAULT_MAX_CONNECTIONS
            }
        },
        Err(_) => DEFAULT_MAX_CONNECTIONS,
    };
    let cap = fd_limit().map(|n| ((n as f64 * FD_SHARE_FOR_CONNECTIONS) as usize).max(1));
    match cap {
        Some(cap) if cap < wanted => {
            tracing::warn!(
                "connection limit lowered from {wanted} to {cap}: {} of the descriptor limit ({}); raise `ulimit -n` for more",
                FD_SHARE_FOR_CONNECTIONS,
                fd_limit().unwrap_or(0)
            );
            cap
        }
        _ => wanted,
    }
}

/// The soft RLIMIT_NOFILE, if known.
fn fd_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: a valid pointer to an rlimit.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 && lim.rlim_cur != libc::RLIM_INFINITY {
            return Some(lim.rlim_cur);
        }
    }
    None
}

/// A connection admitted under the limit; its slot is freed when this is dropped.
#[derive(Debug)]
pub struct Admitted<S> {
    pub stream: S,
    pub peer: String,
    pub permit: OwnedSemaphorePermit,
}

/// Something connections are accepted from (a TCP or Unix listener).
pub trait Acceptor {
    type Stream: Send + 'static;
    fn accept_one(&self) -> impl std::future::Future<Output = std::io::Result<(Self::Stream, String)>> + Send;
}

impl Acceptor for TcpListener {
    type Stream = TcpStream;
    async fn accept_one(&self) -> std::io::Result<(TcpStream, String)> {
        let (s, a): (TcpStream, SocketAddr) = self.accept().await?;
        let _ = s.set_nodelay(true);
        Ok((s, a.to_string()))
    }
}

#[cfg(unix)]
impl Acceptor for tokio::net::UnixListener {
    type Stream = tokio::net::UnixStream;
    async fn accept_one(&self) -> std::io::Result<(tokio::net::UnixStream, String)> {
        let (s, _) = self.accept().await?;
        Ok((s, "unix".to_string()))
    }
}

/// Whether an accept error means the process lacks a resource (wait before retrying) rather
/// than a problem of the one connection (retry at once).
fn lacks_resources(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM))
}

/// Accept state of one listener: its name (for the log), its backoff and its refusal counts.
#[derive(Debug)]
pub struct Listener<A> {
    inner: A,
    what: String,
    limit: ConnLimit,
    refused: AtomicU64,
    last_refusal_log: Mutex<Option<Instant>>,
}

impl<A: Acceptor> Listener<A> {
    /// `what` names the listener in the log (e.g. "metadata service").
    pub fn new(inner: A, what: impl Into<String>, limit: ConnLimit) -> Self {
        Listener { inner, what: what.into(), limit, refused: AtomicU64::new(0), last_refusal_log: Mutex::new(None) }
    }

    pub fn inner(&self) -> &A {
        &self.inner
    }

    /// The next connection admitted under the limit. Never fails: accept errors are logged
    /// and waited out, connections over the limit are closed at once.
    pub async fn accept(&self) -> Admitted<A::Stream> {
        let mut backoff_ms = 0u64;
        let mut failures = 0u64;
        loop {
            match self.inner.accept_one().await {
                Ok((stream, peer)) => {
                    if failures > 0 {
                        tracing::warn!("{}: accepting again after {failures} failed attempts", self.what);
                        (failures, backoff_ms) = (0, 0);
                    }
                    let Some(permit) = self.limit.try_admit() else {
                        drop(stream); // closed at once: the excess never holds a descriptor
                        self.log_refusal(&peer);
                        continue;
                    };
                    return Admitted { stream, peer, permit };
                }
                Err(e) if lacks_resources(&e) => {
                    if failures == 0 {
                        tracing::error!(
                            "{}: cannot accept connections: {e} ({} connections served, limit {}); retrying every {BACKOFF_MAX_MS} ms at most",
                            self.what,
                            self.limit.in_use(),
                            self.limit.max()
                        );
                    }
                    failures += 1;
                    backoff_ms = (backoff_ms * 2).clamp(BACKOFF_MIN_MS, BACKOFF_MAX_MS);
                    tokio::time::sleep(Duration::from_millis(backoff_ms)).await;
                }
                Err(e) => {
                    // ECONNABORTED, EPROTO, EPERM (firewall)...: that connection's problem.
                    tracing::debug!("{}: accept: {e}", self.what);
                    tokio::task::yield_now().await;
                }
            }
        }
    }

    fn log_refusal(&self, peer: &str) {
        let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        let mut last = self.last_refusal_log.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_none_or(|t| t.elapsed() >= REFUSAL_LOG_INTERVAL) {
            *last = Some(Instant::now());
            tracing::warn!(
                "{}: refusing connection from {peer}: {} connections already ({MAX_CONNECTIONS_ENV}); {n} refused so far",
                self.what,
                self.limit.max()
            );
        }
    }

    /// Connections refused for the limit so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

/// Accepts forever on `listener` under the process's limit, spawning `serve` for each admitted
/// connection (its slot is held until `serve` ends).
pub async fn serve<A, F, Fut>(listener: A, what: impl Into<String>, serve: F)
where
    A: Acceptor,
    F: Fn(A::Stream, String) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let l = Listener::new(listener, what, ConnLimit::process());
    loop {
        let c = l.accept().await;
        let fut = serve(c.stream, c.peer);
        let permit = c.permit;
        tokio::spawn(async move {
            fut.await;
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn connections_over_the_limit_are_closed_at_once() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let l = Arc::new(Listener::new(l, "test", ConnLimit::new(2)));
        let l2 = l.clone();
        let server = tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                held.push(l2.accept().await);
            }
        });
        let mut conns = Vec::new();
        for _ in 0..3 {
            conns.push(TcpStream::connect(addr).await.unwrap());
        }
        // The third is closed by the server without a byte.
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), conns[2].read(&mut b)).await.expect("the excess connection was not closed");
        assert!(matches!(n, Ok(0) | Err(_)));
        assert_eq!(l.refused(), 1);
        // The first two are held open.
        assert!(tokio::time::timeout(Duration::from_millis(200), conns[0].read(&mut b)).await.is_err());
        server.abort();
    }

    /// An acceptor failing as a process out of descriptors does, then recovering.
    struct Failing {
        script: Mutex<VecDeque<std::io::Result<()>>>,
        attempts: AtomicU64,
    }

    impl Acceptor for Failing {
        type Stream = ();
        async fn accept_one(&self) -> std::io::Result<((), String)> {
            self.attempts.fetch_add(1, Ordering::Relaxed);
            let next = self.script.lock().unwrap().pop_front();
            match next {
                Some(r) => r.map(|()| ((), "x".into())),
                None => std::future::pending().await,
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn emfile_is_waited_out_with_backoff_not_retried_in_a_loop() {
        let emfile = || Err(std::io::Error::from_raw_os_error(libc::EMFILE));
        let mut script: VecDeque<_> = (0..20).map(|_| emfile()).collect();
        script.push_back(Ok(()));
        let l = Listener::new(Failing { script: Mutex::new(script), attempts: AtomicU64::new(0) }, "test", ConnLimit::new(4));
        let t0 = tokio::time::Instant::now();
        let c = l.accept().await;
        assert_eq!(c.peer, "x");
        assert_eq!(l.inner().attempts.load(Ordering::Relaxed), 21);
        // 10 + 20 + 40 + 80 + 16 x 100 ms of (virtual) waiting: backed off, not spinning.
        assert_eq!(t0.elapsed(), Duration::from_millis(10 + 20 + 40 + 80 + 16 * 100));
    }
}
