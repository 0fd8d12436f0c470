//! A [`KvTarget`] for Redis: a minimal RESP2 client over tokio TCP, one command in flight.
//!
//! - get → `GET`, put → `SET`, insert → `SET` (and `ZADD` to the scan index, if enabled),
//!   read-modify-write → `GET` then `SET` (two round trips, not atomic — as YCSB's is).
//! - **Scans are emulated, not native**: Redis has no ordered key space. With
//!   [`RedisOptions::scan_index`] every insert also adds its key to one sorted set with score 0
//!   (`ZADD`), which Redis orders by key bytes; a scan is `ZRANGEBYLEX index [start + LIMIT 0 n`
//!   followed by `MGET` of those keys (two round trips). This is the approach of YCSB's own
//!   Redis binding (which scores by key hash instead). Inserts then cost two round trips and
//!   the index is not updated atomically with the value. Without the index, scans are
//!   [`TargetError::Unsupported`].
//! - After a connection error or timeout the connection is dropped (its reply stream is no
//!   longer in step) and the next operation connects again.
//!
//! [`BlockingClient`] is the same protocol over std TCP, for one-thread-per-client loads.
//!
//! [`RedisServer`] starts a private `redis-server` (Debian's package) on a free loopback port in
//! a temporary directory, for tests and benchmarks, and kills it by pid when dropped.

mod blocking;
mod resp;
mod server;

pub use blocking::BlockingClient;
pub use resp::{encode_command, parse_reply, Limits, ProtocolError, Reply};
pub use server::{AppendFsync, RedisServer, RedisServerOptions, ServerError};

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::target::{KvTarget, TargetError};

/// How the client talks to Redis.
#[derive(Clone, Debug)]
pub struct RedisOptions {
    pub connect_timeout: Duration,
    /// Longest wait for one reply; past it the operation fails and the connection is dropped.
    pub op_timeout: Duration,
    pub limits: Limits,
    /// Keep a sorted-set index of inserted keys so that scans work (see the module docs).
    pub scan_index: bool,
    /// The sorted set's key (must not collide with record keys).
    pub index_key: Vec<u8>,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            connect_timeout: Duration::from_secs(5),
            op_timeout: Duration::from_secs(10),
            limits: Limits::default(),
            scan_index: false,
            index_key: b"ycsb:index".to_vec(),
        }
    }
}

/// Bytes read from the socket at a time.
const READ_CHUNK_BYTES: usize = 64 << 10;

/// One connection, one command in flight.
struct Connection {
    stream: TcpStream,
    /// Bytes received but not yet parsed; bounded by the limits (one reply at a time).
    buffer: Vec<u8>,
    out: Vec<u8>,
}

impl Connection {
    async fn command(&mut self, args: &[&[u8]], limits: &Limits) -> Result<Reply, TargetError> {
        self.out.clear();
        encode_command(&mut self.out, args);
        self.stream
            .write_all(&self.out)
            .await
            .map_err(|e| TargetError::Io(format!("send: {e}")))?;
        loop {
            match parse_reply(&self.buffer, limits) {
                Ok(Some((reply, used))) => {
                    self.buffer.drain(..used);
                    return Ok(reply);
                }
                Ok(None) => {}
                Err(e) => return Err(TargetError::Store(format!("protocol: {e}"))),
            }
            // Appends into spare capacity, without zeroing it first.
            self.buffer.reserve(READ_CHUNK_BYTES);
            let n = self
                .stream
                .read_buf(&mut self.buffer)
                .await
                .map_err(|e| TargetError::Io(format!("receive: {e}")))?;
            if n == 0 {
                return Err(TargetError::Io("the server closed the connection".into()));
            }
        }
    }
}

/// A Redis client as a [`KvTarget`]; make one per benchmark client.
pub struct RedisTarget {
    addr: SocketAddr,
    options: RedisOptions,
    connection: Option<Connection>,
}

impl RedisTarget {
    /// Connects to Redis at `addr` (and checks it answers `PING`).
    pub async fn connect(
        addr: SocketAddr,
        options: RedisOptions,
    ) -> Result<RedisTarget, TargetError> {
        let mut target = RedisTarget {
            addr,
            options,
            connection: None,
        };
        match target.call(&[b"PING"]).await? {
            Reply::Simple(s) if s == "PONG" => Ok(target),
            other => Err(TargetError::Store(format!("PING answered {other:?}"))),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends one command and waits for its reply; reconnects first if the last one failed.
    pub async fn call(&mut self, args: &[&[u8]]) -> Result<Reply, TargetError> {
        if self.connection.is_none() {
            let stream =
                tokio::time::timeout(self.options.connect_timeout, TcpStream::connect(self.addr))
                    .await
                    .map_err(|_| TargetError::Io(format!("connecting to {} timed out", self.addr)))?
                    .map_err(|e| {
                        TargetError::Io(format!("cannot connect to redis at {}: {e}", self.addr))
                    })?;
            // One small request at a time: Nagle's delay would only add latency.
            stream
                .set_nodelay(true)
                .map_err(|e| TargetError::Io(format!("set TCP_NODELAY: {e}")))?;
            self.connection = Some(Connection {
                stream,
                buffer: Vec::new(),
                out: Vec::new(),
            });
        }
        let limits = self.options.limits;
        let connection = self.connection.as_mut().expect("connected above");
        let result =
            match tokio::time::timeout(self.options.op_timeout, connection.command(args, &limits))
                .await
            {
                Ok(result) => result,
                Err(_) => Err(TargetError::Io(format!(
                    "no reply within {} ms",
                    self.options.op_timeout.as_millis()
                ))),
            };
        if result.is_err() {
            // The reply stream may be out of step with our requests: start afresh.
            self.connection = None;
        }
        match result? {
            Reply::Error(e) => Err(TargetError::Store(e)),
            reply => Ok(reply),
        }
    }
}

fn unexpected(command: &str, reply: Reply) -> TargetError {
    TargetError::Store(format!("unexpected reply to {command}: {reply:?}"))
}

impl KvTarget for RedisTarget {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, TargetError> {
        match self.call(&[b"GET", key]).await? {
            Reply::Bulk(value) => Ok(value),
            other => Err(unexpected("GET", other)),
        }
    }

    async fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), TargetError> {
        match self.call(&[b"SET", key, value]).await? {
            Reply::Simple(s) if s == "OK" => Ok(()),
            other => Err(unexpected("SET", other)),
        }
    }

    async fn insert(&mut self, key: &[u8], value: &[u8]) -> Result<(), TargetError> {
        self.put(key, value).await?;
        if self.options.scan_index {
            let index = self.options.index_key.clone();
            match self.call(&[b"ZADD", &index, b"0", key]).await? {
                Reply::Integer(_) => {}
                other => return Err(unexpected("ZADD", other)),
            }
        }
        Ok(())
    }

    async fn scan(&mut self, start: &[u8], count: usize) -> Result<crate::Records, TargetError> {
        if !self.options.scan_index {
            return Err(TargetError::Unsupported {
                operation: "scan",
                target: "redis",
                hint: "Redis keeps no key order; enable the adapter's scan index (a sorted set of \
                       keys, filled by inserts) before the load phase",
            });
        }
        let mut from = b"[".to_vec();
        from.extend_from_slice(start);
        let index = self.options.index_key.clone();
        let limit = count.to_string();
        let keys = match self
            .call(&[
                b"ZRANGEBYLEX",
                &index,
                &from,
                b"+",
                b"LIMIT",
                b"0",
                limit.as_bytes(),
            ])
            .await?
        {
            Reply::Array(Some(items)) => items
                .into_iter()
                .map(|item| match item {
                    Reply::Bulk(Some(k)) => Ok(k),
                    other => Err(unexpected("ZRANGEBYLEX", other)),
                })
                .collect::<Result<Vec<_>, _>>()?,
            other => return Err(unexpected("ZRANGEBYLEX", other)),
        };
        if keys.is_empty() {
            return Ok(vec![]);
        }
        let mut args: Vec<&[u8]> = vec![b"MGET"];
        args.extend(keys.iter().map(Vec::as_slice));
        let values = match self.call(&args).await? {
            Reply::Array(Some(items)) if items.len() == keys.len() => items,
            other => return Err(unexpected("MGET", other)),
        };
        let mut records = Vec::with_capacity(keys.len());
        for (key, value) in keys.into_iter().zip(values) {
            match value {
                Reply::Bulk(Some(v)) => records.push((key, v)),
                // Indexed but without a value: left out, and the runner's checks see the gap
                // if it was the start key.
                Reply::Bulk(None) => {}
                other => return Err(unexpected("MGET", other)),
            }
        }
        Ok(records)
    }
}
