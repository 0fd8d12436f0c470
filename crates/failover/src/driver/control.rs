//! The monitor's control port (one request per line: `status`, a fault to inject into the
//! primary, an oracle hint) and the fault injection itself (tests, benchmarks, the demo).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use crate::core::Monitor;
use crate::endpoint::Proxy;
use super::pools::AnyPool;
use crate::proto::{Durable, InstanceId};

/// Longest control request line.
pub const MAX_CONTROL_LINE_BYTES: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL of the whole instance (no flush).
    Kill,
    /// Clean stop: SIGTERM, wait, unmount.
    Stop,
    /// SIGSTOP for the duration (0: until resumed by hand... here: for good).
    Pause,
    /// Network link cut for the duration (0: for good).
    Cut,
}

impl std::str::FromStr for FaultKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "kill" => FaultKind::Kill,
            "stop" => FaultKind::Stop,
            "pause" => FaultKind::Pause,
            "cut" => FaultKind::Cut,
            _ => return Err(format!("unknown fault {s:?} (kill, stop, pause, cut)")),
        })
    }
}

#[derive(Serialize, Debug, Clone)]
pub struct Status {
    /// At rest: the primary serves, nothing suspected, no operation queued or running, no
    /// retry pending ([`Monitor::settled`]). What tests wait for before looking around.
    pub settled: bool,
    pub state: Durable,
    /// The endpoint in this process (None on the control store: the endpoints follow it).
    pub endpoint: Option<SocketAddr>,
    pub endpoint_target: Option<SocketAddr>,
    pub instances: Vec<InstanceStatus>,
}

#[derive(Serialize, Debug, Clone)]
pub struct InstanceStatus {
    pub id: InstanceId,
    pub addr: Option<SocketAddr>,
    /// (application, attach helper)
    pub pids: Option<(u32, u32)>,
    /// Its network namespace, when it runs in one.
    pub netns: Option<crate::netns::NetnsLink>,
    /// Where its start went (attach steps, application spawned).
    pub start: Option<crate::pool::StartTiming>,
    /// The host whose failover agent runs it (None: this monitor's own process tree).
    pub host: Option<String>,
}

pub enum Control {
    Fault { kind: FaultKind, duration_ms: u64, reply: oneshot::Sender<Result<String, String>> },
    Status(oneshot::Sender<Status>),
    Hint { primary_back_after_ms: Option<u64>, recovery_ms: u64 },
}

/// The answer to `status`: the monitor's state, the endpoint, the instances. `busy`: the
/// operations queued or running on the workers.
pub(super) fn status(m: &Monitor, pool: &AnyPool, endpoint: Option<&Proxy>, busy: usize) -> Status {
    Status {
        settled: m.settled() && busy == 0,
        state: m.durable().clone(),
        endpoint: endpoint.map(|e| e.local_addr()),
        endpoint_target: endpoint.and_then(|e| e.target()),
        instances: pool.status(),
    }
}

/// Serves control requests (one line each) on `listener`: `status`, `kill`, `stop`,
/// `pause MS`, `cut MS`, `hint BACK_MS|never RECOVERY_MS`, each connection after the cluster's
/// challenge-response handshake ([`wire::auth`]): a fault injection kills or cuts a primary,
/// so the port must not obey whoever reaches it once the monitor runs on a routable address.
/// A client that fails the handshake is closed before any request is read.
///
/// `tls`: the process's cluster-link TLS ([`wire::link::process`]): off the machine (or always,
/// as it says) the port speaks mutual TLS under the handshake, as the other cluster links do;
/// a client that does not is refused.
pub async fn serve_control(listener: TcpListener, secret: Vec<u8>, tls: Option<wire::link::LinkTls>, tx: mpsc::Sender<Control>) {
    let secret: Arc<[u8]> = secret.into();
    let tls = tls.map(Arc::new);
    // Accept errors are waited out with backoff (retrying at once spins a core).
    wire::listen::serve(listener, "failover control port", move |s, peer| {
        let tx = tx.clone();
        let secret = secret.clone();
        let tls = tls.clone();
        async move {
            // Both handshakes have their own deadline (an idle connection is closed by it).
            let mut s = match wire::link::accept(s, tls.as_deref()).await {
                Ok(l) => l,
                Err(e) => return tracing::warn!("failover control port: refused {peer}: {e}"),
            };
            if let Err(e) = wire::auth::accept(&mut s, &secret).await {
                tracing::warn!("failover control port: refused {peer}: {e}");
                return;
            }
            let (r, mut w) = s.into_split();
            let mut lines = BufReader::new(r.take(MAX_CONTROL_LINE_BYTES as u64 * 16)).lines();
            // The tools send their line at once: a connection that sends no request within
            // the authentication deadline is closed, so it cannot hold a slot.
            while let Ok(Ok(Some(line))) = tokio::time::timeout(wire::listen::AUTH_DEADLINE, lines.next_line()).await {
                let reply = control_request(&tx, line.trim()).await;
                let text = match reply {
                    Ok(t) => format!("ok {t}\n"),
                    Err(e) => format!("error {e}\n"),
                };
                // Over TLS the answer's last record may wait in the session until a flush.
                if w.write_all(text.as_bytes()).await.is_err() || w.flush().await.is_err() {
                    return;
                }
            }
        }
    })
    .await
}

async fn control_request(tx: &mpsc::Sender<Control>, line: &str) -> Result<String, String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let ms = |i: usize| -> Result<u64, String> {
        words.get(i).map(|w| w.parse::<u64>().map_err(|_| format!("{w:?} is not a number of milliseconds"))).unwrap_or(Ok(0))
    };
    match words.first().copied() {
        Some("status") => {
            let (otx, orx) = oneshot::channel();
            tx.send(Control::Status(otx)).await.map_err(|_| "monitor stopped".to_string())?;
            let s = orx.await.map_err(|_| "monitor stopped".to_string())?;
            Ok(serde_json::to_string(&s).unwrap())
        }
        Some("hint") => {
            let back = match words.get(1) {
                Some(&"never") => None,
                _ => Some(ms(1)?),
            };
            tx.send(Control::Hint { primary_back_after_ms: back, recovery_ms: ms(2)? }).await.map_err(|_| "monitor stopped".to_string())?;
            Ok("hint taken".into())
        }
        Some(f) => {
            let kind: FaultKind = f.parse()?;
            let (otx, orx) = oneshot::channel();
            tx.send(Control::Fault { kind, duration_ms: ms(1)?, reply: otx }).await.map_err(|_| "monitor stopped".to_string())?;
            orx.await.map_err(|_| "monitor stopped".to_string())?
        }
        None => Err("empty request".into()),
    }
}

/// Injects a fault into the current primary (tests, benchmarks, the demo).
pub(super) async fn inject(pool: &AnyPool, primary: InstanceId, kind: FaultKind, duration_ms: u64) -> Result<String, String> {
    if pool.address(primary).is_none() {
        return Err(format!("primary {primary} is not running"));
    }
    match kind {
        FaultKind::Kill => {
            // Not the pool's kill: detaching is the monitor's job (its fence). A crash is the
            // disk cut off (the helper's FUSE connection aborted: nothing more reaches the
            // volume) and the application SIGKILLed.
            pool.crash(primary).await.map_err(|e| e.to_string())?;
        }
        FaultKind::Stop => {
            let pool = pool.clone();
            tokio::spawn(async move {
                if let Err(e) = pool.stop(primary).await {
                    tracing::warn!("clean stop of {primary}: {e}");
                }
            });
        }
        FaultKind::Pause | FaultKind::Cut => {
            let set = |on: bool| {
                let pool = pool.clone();
                async move {
                    match kind {
                        FaultKind::Pause => pool.pause(primary, on).await,
                        _ => pool.cut(primary, on).await,
                    }
                }
            };
            set(true).await.map_err(|e| e.to_string())?;
            if duration_ms > 0 {
                let pool = pool.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(duration_ms)).await;
                    let r = match kind {
                        FaultKind::Pause => pool.pause(primary, false).await,
                        _ => pool.cut(primary, false).await,
                    };
                    if let Err(e) = r {
                        tracing::info!("healing {primary}: {e}");
                    }
                });
            }
        }
    }
    Ok(format!("{kind:?} injected into primary {primary}"))
}

#[cfg(test)]
mod control_port_tests {
    use super::*;
    use std::time::Instant;
    use tokio::io::AsyncBufReadExt;

    const SECRET: &[u8] = b"control-port-test-secret";

    /// A control port with a monitor stand-in that counts the requests reaching it.
    async fn port() -> (std::net::SocketAddr, mpsc::Receiver<Control>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = mpsc::channel::<Control>(64);
        tokio::spawn(serve_control(l, SECRET.to_vec(), None, tx));
        (addr, rx)
    }

    /// One request line over a connection; the answer line ("" when closed without one).
    async fn ask(s: tokio::net::TcpStream, line: &str) -> String {
        let (r, mut w) = s.into_split();
        let _ = w.write_all(format!("{line}\n").as_bytes()).await;
        let mut answer = String::new();
        let _ = tokio::time::timeout(wire::listen::AUTH_DEADLINE * 3, BufReader::new(r).read_line(&mut answer)).await;
        answer
    }

    /// Before the port took the secret, a plain connection sending `kill` reached the monitor
    /// (this test failed: "a client without the secret reached the monitor with `kill`"). Now
    /// neither a client that skips the handshake nor one with the wrong secret gets a request
    /// through, and neither gets an answer.
    #[tokio::test]
    async fn an_unauthenticated_client_issues_no_command() {
        let (addr, mut rx) = port().await;
        let plain = tokio::net::TcpStream::connect(addr).await.unwrap();
        let answer = ask(plain, "kill").await;
        assert!(!answer.contains("ok"), "a client without the secret got an answer: {answer:?}");

        let mut wrong = tokio::net::TcpStream::connect(addr).await.unwrap();
        let r = wire::auth::connect(&mut wrong, b"not-the-secret").await;
        assert!(r.is_err(), "the handshake with a wrong secret succeeded");
        let answer = ask(wrong, "kill").await;
        assert!(answer.is_empty(), "a client with the wrong secret got an answer: {answer:?}");

        let got = tokio::time::timeout(std::time::Duration::from_millis(500), rx.recv()).await;
        assert!(!matches!(got, Ok(Some(_))), "a client without the secret reached the monitor");

        // The same request with the secret does reach it (the test can tell the two apart).
        let mut good = tokio::net::TcpStream::connect(addr).await.unwrap();
        wire::auth::connect(&mut good, SECRET).await.unwrap();
        let asked = tokio::spawn(ask(good, "hint 10 20"));
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), rx.recv()).await;
        assert!(matches!(got, Ok(Some(Control::Hint { primary_back_after_ms: Some(10), recovery_ms: 20 }))));
        assert_eq!(asked.await.unwrap().trim(), "ok hint taken");
    }

    /// A flood of idle connections neither stops the control port nor stays open past the
    /// deadline; a real request is answered afterwards.
    #[tokio::test]
    async fn control_port_survives_a_flood_and_closes_idle_connections() {
        let (addr, mut rx) = port().await;
        tokio::spawn(async move { while rx.recv().await.is_some() {} });
        let mut flood = Vec::new();
        for _ in 0..300 {
            flood.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        drop(flood);
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        wire::auth::connect(&mut s, SECRET).await.unwrap();
        let (r, mut w) = s.into_split();
        w.write_all(b"hint 10 20\n").await.unwrap();
        let mut line = String::new();
        tokio::time::timeout(std::time::Duration::from_secs(10), BufReader::new(r).read_line(&mut line)).await.unwrap().unwrap();
        assert_eq!(line.trim(), "ok hint taken");

        let t0 = Instant::now();
        let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
        // (It is sent the handshake's hello, then closed at the deadline.)
        let mut b = Vec::new();
        let n = tokio::time::timeout(wire::listen::AUTH_DEADLINE * 3, idle.read_to_end(&mut b)).await;
        assert!(matches!(n, Ok(Ok(_)) | Ok(Err(_))), "an idle control connection stayed open for {:?}", t0.elapsed());
    }

    /// Issue 24 item 6: the control port (which kills and cuts primaries) over TLS when the
    /// process's link setting asks for it. A client that skips TLS gets nothing through, even
    /// with the secret; one with a certificate from the cluster's CA is served.
    #[tokio::test]
    async fn a_tls_control_port_refuses_a_plain_client_and_serves_a_tls_one() {
        let dir = tempfile::tempdir().unwrap();
        let pki = wire::tls::TestPki::write(dir.path());
        let tls = wire::link::LinkTls::from_files(&pki.server_files(true), wire::link::LinkPolicy::Always).unwrap();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, mut rx) = mpsc::channel::<Control>(64);
        tokio::spawn(serve_control(l, SECRET.to_vec(), Some(tls.clone()), tx));

        let mut plain = tokio::net::TcpStream::connect(addr).await.unwrap();
        let r = tokio::time::timeout(wire::listen::AUTH_DEADLINE * 3, wire::auth::connect(&mut plain, SECRET)).await;
        assert!(!matches!(r, Ok(Ok(()))), "a plain client passed the handshake of a TLS port");
        let answer = ask(plain, "hint 10 20").await;
        assert!(answer.is_empty(), "a plain client got an answer: {answer:?}");
        let got = tokio::time::timeout(std::time::Duration::from_millis(500), rx.recv()).await;
        assert!(!matches!(got, Ok(Some(_))), "a plain client reached the monitor");

        let sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut link = wire::link::connect(sock, Some(&tls)).await.unwrap();
        assert!(link.is_tls());
        wire::auth::connect(&mut link, SECRET).await.unwrap();
        let asked = tokio::spawn(async move {
            link.write_all(b"hint 10 20\n").await.unwrap();
            link.flush().await.unwrap();
            let mut answer = String::new();
            BufReader::new(link).read_line(&mut answer).await.unwrap();
            answer
        });
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), rx.recv()).await;
        assert!(matches!(got, Ok(Some(Control::Hint { primary_back_after_ms: Some(10), recovery_ms: 20 }))));
        assert_eq!(asked.await.unwrap().trim(), "ok hint taken");
    }
}
