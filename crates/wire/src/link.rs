//! Cluster links (shards, metadata service, kv nodes, log peers) over TLS when they leave the
//! machine: a [`Link`] is a plain TCP stream or a mutual-TLS stream over one, chosen by
//! [`LinkPolicy`]; the framed messages and the cluster-secret handshake ([`crate::auth`]) run
//! on it unchanged.
//!
//! Both ends decide alone and alike: the client by the address it dials, the server by the
//! address the connection comes from; a connection to a loopback address comes from one, so
//! under [`LinkPolicy::OffMachine`] the two agree (a disagreement fails the handshake, it never
//! falls back to plain). Mutual TLS: every process of the cluster has a certificate from the
//! cluster's CA, presents it as client and as server, and accepts only peers with one; a
//! client checks the server's certificate against the IP address it dialed (peers are dialed
//! by address), so each certificate names its host's addresses.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf, ReadHalf, WriteHalf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::tls::{rustls, tokio_rustls, ServerFiles};
use crate::WireError;

/// When a link runs over TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkPolicy {
    /// Never (one machine, or a network trusted by other means).
    Off,
    /// Unless the peer is on a loopback address: the default once TLS files are given, so a
    /// cluster on one machine pays nothing.
    OffMachine,
    /// Always, loopback included (tests; the paranoid).
    Always,
}

/// A process's TLS identity for cluster links, and when to use it.
#[derive(Clone)]
pub struct LinkTls {
    policy: LinkPolicy,
    acceptor: tokio_rustls::TlsAcceptor,
    connector: tokio_rustls::TlsConnector,
}

impl LinkTls {
    /// From this process's certificate and key and the cluster CA (`files.client_ca`, required:
    /// links are mutual TLS).
    pub fn from_files(files: &ServerFiles, policy: LinkPolicy) -> Result<LinkTls, WireError> {
        let ca = files
            .client_ca
            .as_deref()
            .ok_or_else(|| WireError::Tls("cluster links need the cluster CA to check their peers".into()))?;
        let server = crate::tls::server_config(files)?;
        let client = crate::tls::client_config(ca, Some((&files.cert, &files.key)))?;
        Ok(LinkTls { policy, acceptor: server.into(), connector: client.into() })
    }

    pub fn policy(&self) -> LinkPolicy {
        self.policy
    }

    /// Whether a link with `peer` runs over TLS.
    pub fn wants_tls(&self, peer: SocketAddr) -> bool {
        wants_tls(self.policy, peer)
    }

    /// The client side's rustls configuration, for blocking clients (`rustls::StreamOwned`:
    /// the nearlog shim runs inside applications, without a tokio runtime).
    pub fn client_config(&self) -> &std::sync::Arc<rustls::ClientConfig> {
        self.connector.config()
    }
}

/// Whether a link with `peer` runs over TLS under `policy`.
pub fn wants_tls(policy: LinkPolicy, peer: SocketAddr) -> bool {
    match policy {
        LinkPolicy::Off => false,
        LinkPolicy::OffMachine => !peer.ip().is_loopback() && !peer.ip().to_canonical().is_loopback(),
        LinkPolicy::Always => true,
    }
}

/// Environment variable choosing when this process's cluster links run over TLS: `off`,
/// `off-machine` (plain on loopback; the default once certificate files are given) or
/// `always`. Read once per process, like [`crate::listen::MAX_CONNECTIONS_ENV`], so every
/// daemon and client of a cluster takes the same setting without an option on each command.
pub const LINK_TLS_ENV: &str = "UNDERSTUDY_LINK_TLS";
/// This process's certificate (PEM; it names its host's addresses).
pub const LINK_TLS_CERT_ENV: &str = "UNDERSTUDY_LINK_TLS_CERT";
/// The key of [`LINK_TLS_CERT_ENV`].
pub const LINK_TLS_KEY_ENV: &str = "UNDERSTUDY_LINK_TLS_KEY";
/// The cluster CA that every peer's certificate must chain to.
pub const LINK_TLS_CA_ENV: &str = "UNDERSTUDY_LINK_TLS_CA";

/// The link TLS configuration from `var` (the environment's, in [`process`]).
pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Option<LinkTls>, WireError> {
    let files = [LINK_TLS_CERT_ENV, LINK_TLS_KEY_ENV, LINK_TLS_CA_ENV].map(|v| var(v).filter(|s| !s.is_empty()));
    let policy = match var(LINK_TLS_ENV).as_deref() {
        None | Some("") if files.iter().all(Option::is_none) => return Ok(None),
        None | Some("") | Some("off-machine") => LinkPolicy::OffMachine,
        Some("off") => return Ok(None),
        Some("always") => LinkPolicy::Always,
        Some(other) => return Err(WireError::Tls(format!("{LINK_TLS_ENV}={other:?}: expected off, off-machine or always"))),
    };
    let [Some(cert), Some(key), Some(ca)] = files else {
        return Err(WireError::Tls(format!(
            "cluster links over TLS need {LINK_TLS_CERT_ENV}, {LINK_TLS_KEY_ENV} and {LINK_TLS_CA_ENV} (or {LINK_TLS_ENV}=off)"
        )));
    };
    let files = ServerFiles { cert: cert.into(), key: key.into(), client_ca: Some(ca.into()) };
    LinkTls::from_files(&files, policy).map(Some)
}

/// This process's link TLS configuration, read from the environment once ([`from_env`]).
/// Daemons call it at start so a bad setting stops them with its reason.
pub fn process() -> Result<Option<&'static LinkTls>, WireError> {
    static TLS: std::sync::OnceLock<Result<Option<LinkTls>, String>> = std::sync::OnceLock::new();
    TLS.get_or_init(|| from_env(|v| std::env::var(v).ok()).map_err(|e| e.to_string()))
        .as_ref()
        .map(Option::as_ref)
        .map_err(|e| WireError::Tls(e.clone()))
}

/// A cluster link: plain TCP or TLS over TCP.
pub enum Link {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
}

impl Link {
    pub fn is_tls(&self) -> bool {
        matches!(self, Link::Tls(_))
    }

    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp().peer_addr()
    }

    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.tcp().set_nodelay(on)
    }

    /// The TCP stream under the link (socket options).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Link::Plain(s) => s,
            Link::Tls(t) => t.get_ref().0,
        }
    }

    /// Read and write halves usable from two tasks. A plain link splits as `TcpStream` does
    /// (no lock between the halves: the I/O path of a loopback cluster pays nothing for TLS
    /// being possible); a TLS link through `tokio::io::split`, as one session serves both.
    pub fn into_split(self) -> (LinkRead, LinkWrite) {
        match self {
            Link::Plain(s) => {
                let (r, w) = s.into_split();
                (LinkRead::Plain(r), LinkWrite::Plain(w))
            }
            Link::Tls(t) => {
                let (r, w) = tokio::io::split(*t);
                (LinkRead::Tls(r), LinkWrite::Tls(w))
            }
        }
    }
}

/// The client side: TLS over `sock` when `tls` wants it for the dialed peer.
pub async fn connect(sock: TcpStream, tls: Option<&LinkTls>) -> Result<Link, WireError> {
    let peer = sock.peer_addr()?;
    match tls {
        Some(t) if t.wants_tls(peer) => {
            let name = rustls::pki_types::ServerName::IpAddress(peer.ip().into());
            let s = t
                .connector
                .connect(name, sock)
                .await
                .map_err(|e| WireError::Tls(format!("TLS to {peer}: {e}")))?;
            Ok(Link::Tls(Box::new(s.into())))
        }
        _ => Ok(Link::Plain(sock)),
    }
}

/// The server side: TLS over `sock` when `tls` wants it for the connecting peer. Bounded by
/// [`crate::listen::AUTH_DEADLINE`], as the secret handshake: a peer that never finishes must
/// not hold a connection slot.
pub async fn accept(sock: TcpStream, tls: Option<&LinkTls>) -> Result<Link, WireError> {
    let peer = sock.peer_addr()?;
    match tls {
        Some(t) if t.wants_tls(peer) => {
            let deadline = crate::listen::AUTH_DEADLINE;
            let s = tokio::time::timeout(deadline, t.acceptor.accept(sock))
                .await
                .map_err(|_| WireError::Tls(format!("no TLS handshake from {peer} within {deadline:?}")))?
                .map_err(|e| WireError::Tls(format!("TLS from {peer}: {e}")))?;
            Ok(Link::Tls(Box::new(s.into())))
        }
        _ => Ok(Link::Plain(sock)),
    }
}

/// A daemon's accept of a cluster link, in one call: TLS as this process's link setting wants it
/// for the peer ([`process`], [`accept`]), then the cluster-secret handshake
/// ([`crate::auth::accept`]); each step bounded by [`crate::listen::AUTH_DEADLINE`].
pub async fn accept_authenticated(sock: TcpStream, secret: &[u8]) -> Result<Link, WireError> {
    let mut link = accept(sock, process()?).await?;
    crate::auth::accept(&mut link, secret).await?;
    Ok(link)
}

/// The read half of a [`Link`].
pub enum LinkRead {
    Plain(OwnedReadHalf),
    Tls(ReadHalf<tokio_rustls::TlsStream<TcpStream>>),
}

/// The write half of a [`Link`].
pub enum LinkWrite {
    Plain(OwnedWriteHalf),
    Tls(WriteHalf<tokio_rustls::TlsStream<TcpStream>>),
}

impl AsyncRead for LinkRead {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            LinkRead::Plain(s) => Pin::new(s).poll_read(cx, buf),
            LinkRead::Tls(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for LinkWrite {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            LinkWrite::Plain(s) => Pin::new(s).poll_write(cx, buf),
            LinkWrite::Tls(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            LinkWrite::Plain(s) => Pin::new(s).poll_flush(cx),
            LinkWrite::Tls(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            LinkWrite::Plain(s) => Pin::new(s).poll_shutdown(cx),
            LinkWrite::Tls(s) => Pin::new(s).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            LinkWrite::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            LinkWrite::Tls(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            LinkWrite::Plain(s) => s.is_write_vectored(),
            LinkWrite::Tls(s) => s.is_write_vectored(),
        }
    }
}

impl AsyncRead for Link {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Link::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Link::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Link {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Link::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Link::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Link::Plain(s) => Pin::new(s).poll_flush(cx),
            Link::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Link::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Link::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Link::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Link::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Link::Plain(s) => s.is_write_vectored(),
            Link::Tls(s) => s.is_write_vectored(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::TestPki;
    use serde::{Deserialize, Serialize};
    use std::path::PathBuf;

    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct Ping(u64, Vec<u8>);

    const SECRET: &[u8] = b"link-test-secret";

    struct Dir(PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    fn dir(tag: &str) -> Dir {
        let p = std::env::temp_dir().join(format!("wire-link-{tag}-{}-{}", std::process::id(), rand::random::<u32>()));
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }

    /// A node's identity in a TestPki (the server certificate, which names 127.0.0.1).
    fn identity(p: &TestPki, policy: LinkPolicy) -> LinkTls {
        LinkTls::from_files(&p.server_files(true), policy).unwrap()
    }

    /// A server that accepts one link, authenticates it with the secret and echoes one
    /// framed message; the client's link and echo.
    async fn round_trip(server_tls: Option<LinkTls>, client_tls: Option<LinkTls>) -> Result<(bool, Ping), String> {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let srv = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let mut link = accept(s, server_tls.as_ref()).await.map_err(|e| e.to_string())?;
            crate::auth::accept(&mut link, SECRET).await.map_err(|e| e.to_string())?;
            let (mut r, mut w) = link.into_split();
            let m: Ping = crate::read_msg(&mut r, 1 << 20).await.map_err(|e| e.to_string())?;
            crate::write_msg(&mut w, &m).await.map_err(|e| e.to_string())
        });
        let r = async {
            let s = TcpStream::connect(addr).await.unwrap();
            let mut link = connect(s, client_tls.as_ref()).await.map_err(|e| e.to_string())?;
            crate::auth::connect(&mut link, SECRET).await.map_err(|e| e.to_string())?;
            let tls = link.is_tls();
            crate::write_msg(&mut link, &Ping(7, vec![1; 100_000])).await.map_err(|e| e.to_string())?;
            let m: Ping = crate::read_msg(&mut link, 1 << 20).await.map_err(|e| e.to_string())?;
            Ok((tls, m))
        };
        let r = tokio::time::timeout(std::time::Duration::from_secs(20), r).await.map_err(|_| "client timed out".to_string())?;
        let _ = tokio::time::timeout(std::time::Duration::from_secs(20), srv).await;
        r
    }

    #[tokio::test]
    async fn framed_messages_and_the_secret_run_over_mutual_tls() {
        let d = dir("ok");
        let pki = TestPki::write(&d.0);
        let (tls, m) = round_trip(Some(identity(&pki, LinkPolicy::Always)), Some(identity(&pki, LinkPolicy::Always))).await.unwrap();
        assert!(tls, "the link did not run over TLS");
        assert_eq!(m, Ping(7, vec![1; 100_000]));
        // Loopback under the default policy: plain, and both ends agree.
        let (tls, _) =
            round_trip(Some(identity(&pki, LinkPolicy::OffMachine)), Some(identity(&pki, LinkPolicy::OffMachine))).await.unwrap();
        assert!(!tls, "a loopback link ran over TLS under OffMachine");
    }

    #[tokio::test]
    async fn plain_clients_and_other_clusters_are_refused() {
        let d = dir("refused");
        let pki = TestPki::write(&d.0.join("a"));
        let other = TestPki::write(&d.0.join("b"));
        let r = round_trip(Some(identity(&pki, LinkPolicy::Always)), None).await;
        assert!(r.is_err(), "a plain client got through a TLS link: {r:?}");
        let r = round_trip(Some(identity(&pki, LinkPolicy::Always)), Some(identity(&other, LinkPolicy::Always))).await;
        assert!(r.is_err(), "a client of another cluster's CA got through: {r:?}");
        let r = round_trip(None, Some(identity(&pki, LinkPolicy::Always))).await;
        assert!(r.is_err(), "a TLS client talked to a plain server: {r:?}");
    }

    #[test]
    fn environment_settings() {
        let d = dir("env");
        let pki = TestPki::write(&d.0);
        let f = |n: &str| pki.path(n).to_string_lossy().into_owned();
        let env = |pairs: Vec<(&'static str, String)>| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        assert!(from_env(env(vec![])).unwrap().is_none());
        assert!(from_env(env(vec![(LINK_TLS_ENV, "off".into())])).unwrap().is_none());
        let all = vec![(LINK_TLS_CERT_ENV, f("server-cert.pem")), (LINK_TLS_KEY_ENV, f("server-key.pem")), (LINK_TLS_CA_ENV, f("ca-cert.pem"))];
        assert_eq!(from_env(env(all.clone())).unwrap().unwrap().policy(), LinkPolicy::OffMachine);
        let mut always = all.clone();
        always.push((LINK_TLS_ENV, "always".into()));
        assert_eq!(from_env(env(always)).unwrap().unwrap().policy(), LinkPolicy::Always);
        let e = from_env(env(vec![(LINK_TLS_ENV, "always".into())])).err().unwrap().to_string();
        assert!(e.contains(LINK_TLS_CERT_ENV), "{e}");
        let e = from_env(env(vec![(LINK_TLS_ENV, "sometimes".into())])).err().unwrap().to_string();
        assert!(e.contains("sometimes"), "{e}");
        let e = from_env(env(all[..2].to_vec())).err().unwrap().to_string();
        assert!(e.contains(LINK_TLS_CA_ENV), "{e}");
    }

    #[test]
    fn policy_keeps_loopback_plain_by_default() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        for a in ["127.0.0.1:1", "127.3.4.5:1", "[::1]:1", "[::ffff:127.0.0.1]:1"] {
            assert!(!wants_tls(LinkPolicy::OffMachine, at(a)), "{a}");
            assert!(wants_tls(LinkPolicy::Always, at(a)), "{a}");
        }
        for a in ["10.0.0.4:1", "[2001:db8::1]:1", "[::ffff:10.0.0.4]:1"] {
            assert!(wants_tls(LinkPolicy::OffMachine, at(a)), "{a}");
            assert!(!wants_tls(LinkPolicy::Off, at(a)), "{a}");
        }
    }
}
