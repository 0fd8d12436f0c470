//! A tokio ZooKeeper client: one session on one TCP connection, many requests in flight.
//!
//! ZooKeeper answers a session's requests in order; replies are still matched by xid, so a
//! late or missing reply cannot be handed to the wrong caller. A ping goes out every third of
//! the negotiated session timeout so an idle session does not expire.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::jute::{
    self, FrameSplitter, Reply, Request, Stat, MAX_FRAME_BYTES, XID_NOTIFICATION, XID_PING,
};
use crate::ZkError;

/// Requests one session may have in flight (the writer queue's bound).
pub const INFLIGHT_MAX: usize = 4096;

type Pending = Arc<Mutex<HashMap<i32, oneshot::Sender<Reply>>>>;

/// One session. Share it behind an `Arc`; dropping it closes the connection.
pub struct ZkClient {
    addr: SocketAddr,
    session_id: i64,
    session_timeout: Duration,
    tx: mpsc::Sender<Vec<u8>>,
    pending: Pending,
    next_xid: AtomicI32,
    closed: Arc<AtomicBool>,
    /// Per-request wait for the reply.
    pub request_timeout: Duration,
    tasks: Vec<JoinHandle<()>>,
}

impl ZkClient {
    /// Opens a session on `addr`, asking for `session_timeout` (the server clamps it to
    /// 2–20 ticks). Fails if the server does not answer within `connect_timeout` or refuses
    /// the session (a server that is not serving closes the connection).
    pub async fn connect(
        addr: SocketAddr,
        session_timeout: Duration,
        connect_timeout: Duration,
    ) -> Result<ZkClient, ZkError> {
        let handshake = async {
            let mut s = TcpStream::connect(addr).await?;
            s.set_nodelay(true)?;
            let want = i32::try_from(session_timeout.as_millis()).unwrap_or(i32::MAX);
            s.write_all(&jute::encode_connect(want)).await?;
            let mut splitter = FrameSplitter::new(MAX_FRAME_BYTES);
            let mut buf = vec![0u8; 4096];
            loop {
                if let Some(payload) = splitter.next_frame()? {
                    return Ok::<_, ZkError>((
                        s,
                        jute::decode_connect_response(&payload)?,
                        splitter,
                    ));
                }
                let n = s.read(&mut buf).await?;
                if n == 0 {
                    return Err(ZkError::SessionRefused(addr));
                }
                splitter.push(&buf[..n]);
            }
        };
        let (sock, resp, splitter) = tokio::time::timeout(connect_timeout, handshake)
            .await
            .map_err(|_| ZkError::Timeout(connect_timeout))??;
        if resp.timeout_ms <= 0 {
            return Err(ZkError::SessionRefused(addr));
        }
        let session_timeout = Duration::from_millis(resp.timeout_ms as u64);
        let (mut r, mut w) = sock.into_split();
        let (tx, mut rx) = mpsc::channel::<Vec<u8>>(INFLIGHT_MAX);
        let pending: Pending = Arc::new(Mutex::new(HashMap::new()));
        let closed = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        {
            let closed = closed.clone();
            tasks.push(tokio::spawn(async move {
                while let Some(frame) = rx.recv().await {
                    if w.write_all(&frame).await.is_err() {
                        break;
                    }
                }
                closed.store(true, Ordering::Relaxed);
            }));
        }
        {
            let pending = pending.clone();
            let closed = closed.clone();
            let mut splitter = splitter;
            tasks.push(tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                'read: loop {
                    loop {
                        match splitter.next_frame() {
                            Ok(Some(payload)) => match jute::decode_reply(&payload) {
                                Ok(reply)
                                    if reply.xid == XID_PING || reply.xid == XID_NOTIFICATION => {}
                                Ok(reply) => {
                                    if let Some(waiter) = pending.lock().unwrap().remove(&reply.xid)
                                    {
                                        let _ = waiter.send(reply);
                                    }
                                }
                                Err(e) => {
                                    tracing::warn!(%addr, "closing the session: {e}");
                                    break 'read;
                                }
                            },
                            Ok(None) => break,
                            Err(e) => {
                                tracing::warn!(%addr, "closing the session: {e}");
                                break 'read;
                            }
                        }
                    }
                    match r.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => splitter.push(&buf[..n]),
                    }
                }
                closed.store(true, Ordering::Relaxed);
                // Dropping the senders fails every request still waiting.
                pending.lock().unwrap().clear();
            }));
        }
        {
            let tx = tx.clone();
            let every = session_timeout / 3;
            tasks.push(tokio::spawn(async move {
                let ping = jute::encode_request(XID_PING, &Request::Ping).expect("a ping encodes");
                loop {
                    tokio::time::sleep(every).await;
                    if tx.send(ping.clone()).await.is_err() {
                        return;
                    }
                }
            }));
        }
        Ok(ZkClient {
            addr,
            session_id: resp.session_id,
            session_timeout,
            tx,
            pending,
            next_xid: AtomicI32::new(1),
            closed,
            request_timeout: Duration::from_secs(10),
            tasks,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn session_id(&self) -> i64 {
        self.session_id
    }

    /// The session timeout the server granted.
    pub fn session_timeout(&self) -> Duration {
        self.session_timeout
    }

    /// Whether the connection has closed (every later request fails).
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// Sends `req` and waits for its reply (whatever its error code).
    pub async fn call(&self, req: &Request) -> Result<Reply, ZkError> {
        let xid = self.next_xid.fetch_add(1, Ordering::Relaxed) & 0x7fff_ffff;
        let frame = jute::encode_request(xid, req)?;
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(xid, tx);
        if self.is_closed() || self.tx.send(frame).await.is_err() {
            self.pending.lock().unwrap().remove(&xid);
            return Err(ZkError::ConnectionLost(self.addr));
        }
        match tokio::time::timeout(self.request_timeout, rx).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(_)) => Err(ZkError::ConnectionLost(self.addr)),
            Err(_) => {
                self.pending.lock().unwrap().remove(&xid);
                Err(ZkError::Timeout(self.request_timeout))
            }
        }
    }

    fn check(op: &'static str, path: &str, reply: &Reply) -> Result<(), ZkError> {
        if reply.err == jute::err::OK {
            Ok(())
        } else {
            Err(ZkError::Server {
                op,
                path: path.to_string(),
                code: reply.err,
                name: jute::error_name(reply.err),
            })
        }
    }

    /// Creates a persistent znode; returns the zxid of the create.
    pub async fn create(&self, path: &str, data: &[u8]) -> Result<i64, ZkError> {
        let reply = self
            .call(&Request::Create {
                path: path.into(),
                data: data.to_vec(),
            })
            .await?;
        Self::check("create", path, &reply)?;
        Ok(reply.zxid)
    }

    /// Creates the znode, or sets its data if it exists; returns the zxid of the write.
    pub async fn upsert(&self, path: &str, data: &[u8]) -> Result<i64, ZkError> {
        match self.create(path, data).await {
            Err(ZkError::Server {
                code: jute::err::NODE_EXISTS,
                ..
            }) => Ok(self.set_data(path, data).await?.0),
            other => other,
        }
    }

    /// Sets a znode's data whatever its version; returns the zxid of the write and the stat.
    pub async fn set_data(&self, path: &str, data: &[u8]) -> Result<(i64, Stat), ZkError> {
        let reply = self
            .call(&Request::SetData {
                path: path.into(),
                data: data.to_vec(),
                version: -1,
            })
            .await?;
        Self::check("setData", path, &reply)?;
        Ok((reply.zxid, reply.stat()?))
    }

    /// A znode's data (`None` if it has none) and stat.
    pub async fn get_data(&self, path: &str) -> Result<(Option<Vec<u8>>, Stat), ZkError> {
        let reply = self.call(&Request::GetData { path: path.into() }).await?;
        Self::check("getData", path, &reply)?;
        reply.data()
    }

    /// Closes the session on the server (its ephemeral state goes at once, not at expiry).
    pub async fn close(self) -> Result<(), ZkError> {
        let reply = self.call(&Request::CloseSession).await?;
        Self::check("closeSession", "", &reply)
    }
}

impl Drop for ZkClient {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}
