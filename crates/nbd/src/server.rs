//! The connection driver: handshake, then many requests in flight, replies through one writer.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use blockdev::{BlockDev, DevError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info};

use crate::exports::Exports;
use crate::proto::*;

/// Limits of one server. Every field is a bound on something a client controls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Largest READ or WRITE accepted (also advertised as the maximum block size); larger
    /// requests get EINVAL.
    pub max_request_bytes: u32,
    /// Largest refused WRITE payload read and discarded (in small chunks) to stay in sync with
    /// the stream; a larger one closes the connection.
    pub max_discard_payload_bytes: u32,
    /// Requests of one connection being served at once (reading more waits for a slot).
    pub max_in_flight_requests_per_connection: u32,
    /// READ/WRITE buffer bytes of one connection held at once. Raised to at least
    /// `max_request_bytes` so that one request of the maximum size always fits.
    pub max_in_flight_bytes_per_connection: u32,
    /// Largest option data accepted during the handshake (export names are at most 4096 bytes).
    pub max_option_bytes: u32,
    /// Options one handshake may send before the server gives up on it.
    pub max_options_per_handshake: u32,
    /// Time a client has to finish the handshake.
    pub handshake_timeout_ms: u64,
    /// Connections served at once (TCP and Unix together); further ones are accepted and
    /// closed at once.
    pub max_connections: u32,
    /// Bytes of WRITE payloads being received at once, across all connections: a payload is
    /// read into memory only once its bytes fit, else the connection waits (backpressure: the
    /// bytes stay in the client's socket). Without it, clients that each send the header of a
    /// large write and part of its payload make the server hold all of them. Raised to at
    /// least `max_request_bytes`.
    pub max_incomplete_request_bytes: u32,
    /// Time a WRITE's payload has to arrive once the server started reading it: a client
    /// stalled mid-payload holds part of `max_incomplete_request_bytes`, so it is cut off.
    pub request_payload_timeout_ms: u64,
    /// Preferred block size advertised in NBD_INFO_BLOCK_SIZE (the minimum advertised is 1).
    pub preferred_block_bytes: u32,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_request_bytes: 32 << 20,
            max_discard_payload_bytes: 64 << 20,
            max_in_flight_requests_per_connection: 64,
            max_in_flight_bytes_per_connection: 128 << 20,
            max_option_bytes: 64 << 10,
            max_options_per_handshake: 256,
            handshake_timeout_ms: 30_000,
            // Below the usual descriptor limit of 1024 (see wire::listen).
            max_connections: wire::listen::DEFAULT_MAX_CONNECTIONS as u32,
            max_incomplete_request_bytes: 64 << 20,
            request_payload_timeout_ms: 30_000,
            preferred_block_bytes: 4096,
        }
    }
}

/// Why a connection ended other than by the client's NBD_CMD_DISC or NBD_OPT_ABORT.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("handshake not finished within {0} ms")]
    HandshakeTimeout(u64),
    #[error("TLS handshake failed: {0}")]
    Tls(String),
}

impl From<ParseError> for ConnError {
    fn from(e: ParseError) -> Self {
        ConnError::Protocol(e.to_string())
    }
}

/// An NBD server for the exports `E`.
pub struct Server<E: Exports> {
    exports: E,
    config: ServerConfig,
    /// Shared by the TCP and Unix listeners.
    connections: wire::listen::ConnLimit,
    /// `max_incomplete_request_bytes`, one permit per byte.
    incomplete_bytes: Arc<Semaphore>,
    /// When set, TLS is required: a client must upgrade with NBD_OPT_STARTTLS before any
    /// other option but ABORT (see [`tls_gate`]).
    tls: Option<wire::tls::tokio_rustls::TlsAcceptor>,
}

/// Serves `exports` on a TCP listener with default limits, until the returned future is
/// dropped. Accept errors are logged and retried.
pub async fn serve_tcp<E: Exports>(listener: TcpListener, exports: E) -> io::Result<()> {
    Arc::new(Server::new(exports)).serve_tcp(listener).await
}

/// Serves `exports` on a Unix socket listener with default limits (see [`serve_tcp`]).
pub async fn serve_unix<E: Exports>(listener: UnixListener, exports: E) -> io::Result<()> {
    Arc::new(Server::new(exports)).serve_unix(listener).await
}

/// Bytes read at a time while discarding a refused write payload.
const DISCARD_CHUNK_BYTES: usize = 64 << 10;
/// Read buffer of a connection.
const READ_BUFFER_BYTES: usize = 256 << 10;
/// Write buffer of a connection's reply writer.
const WRITE_BUFFER_BYTES: usize = 256 << 10;

impl<E: Exports> Server<E> {
    pub fn new(exports: E) -> Self {
        Self::with_config(exports, ServerConfig::default())
    }

    pub fn with_config(exports: E, mut config: ServerConfig) -> Self {
        config.max_in_flight_bytes_per_connection = config
            .max_in_flight_bytes_per_connection
            .max(config.max_request_bytes);
        config.max_in_flight_requests_per_connection =
            config.max_in_flight_requests_per_connection.max(1);
        config.max_discard_payload_bytes = config
            .max_discard_payload_bytes
            .max(config.max_request_bytes);
        config.max_incomplete_request_bytes = config
            .max_incomplete_request_bytes
            .max(config.max_request_bytes);
        let connections = wire::listen::ConnLimit::new(config.max_connections as usize);
        let incomplete_bytes = Arc::new(Semaphore::new(config.max_incomplete_request_bytes as usize));
        Server {
            exports,
            config,
            connections,
            incomplete_bytes,
            tls: None,
        }
    }

    /// Requires TLS on every connection (TCP and Unix), negotiated by NBD_OPT_STARTTLS with
    /// this acceptor's certificate (and client-certificate check, if it has one).
    pub fn with_tls(mut self, acceptor: wire::tls::tokio_rustls::TlsAcceptor) -> Self {
        self.tls = Some(acceptor);
        self
    }

    /// Whether connections must negotiate TLS.
    pub fn requires_tls(&self) -> bool {
        self.tls.is_some()
    }

    pub fn config(&self) -> &ServerConfig {
        &self.config
    }

    /// Accepts TCP connections forever, serving each on its own task. Accept errors (e.g. out
    /// of file descriptors) are logged and waited out; connections over `max_connections` are
    /// closed at once (see `wire::listen`).
    pub async fn serve_tcp(self: Arc<Self>, listener: TcpListener) -> io::Result<()> {
        self.serve(listener, "NBD server").await
    }

    /// Accepts Unix socket connections forever, serving each on its own task.
    pub async fn serve_unix(self: Arc<Self>, listener: UnixListener) -> io::Result<()> {
        self.serve(listener, "NBD server (unix socket)").await
    }

    async fn serve<A>(self: Arc<Self>, listener: A, what: &str) -> io::Result<()>
    where
        A: wire::listen::Acceptor,
        A::Stream: AsyncRead + AsyncWrite + Unpin,
    {
        let listener = wire::listen::Listener::new(listener, what, self.connections.clone());
        loop {
            let c = listener.accept().await;
            let server = self.clone();
            tokio::spawn(async move {
                match server.serve_connection(c.stream).await {
                    Ok(()) => debug!("nbd: connection from {} closed", c.peer),
                    Err(e) => info!("nbd: connection from {} ended: {e}", c.peer),
                }
                drop(c.permit);
            });
        }
    }

    /// Serves one connection (any byte stream) to its end: the handshake (upgraded to TLS
    /// when the server requires it), then transmission.
    pub async fn serve_connection<S>(&self, stream: S) -> Result<(), ConnError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let timeout_ms = self.config.handshake_timeout_ms;
        // One deadline for the whole handshake, TLS included: an upgrade does not buy time.
        let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
        let timed_out = |_| ConnError::HandshakeTimeout(timeout_ms);
        let mut options_left = self.config.max_options_per_handshake;
        let mut plain = BufReader::with_capacity(READ_BUFFER_BYTES, stream);
        let state = if self.tls.is_some() { TlsState::Required } else { TlsState::Off };
        let (no_zeroes, outcome) = tokio::time::timeout_at(deadline, async {
            let no_zeroes = self.greeting(&mut plain).await?;
            let outcome = self.options(&mut plain, no_zeroes, state, &mut options_left).await?;
            Ok::<_, ConnError>((no_zeroes, outcome))
        })
        .await
        .map_err(timed_out)??;
        match outcome {
            Handshake::Abort => Ok(()),
            Handshake::Transmission(dev) => self.transmission(plain, dev).await,
            Handshake::StartTls => {
                // Bytes the client sent after STARTTLS but before the TLS handshake would be
                // taken as if they came over TLS (the STARTTLS injection of other protocols).
                if !plain.buffer().is_empty() {
                    return Err(ConnError::Protocol("data after NBD_OPT_STARTTLS before the TLS handshake".into()));
                }
                let acceptor = self.tls.clone().expect("StartTls only when TLS is configured");
                let (tls, outcome) = tokio::time::timeout_at(deadline, async {
                    let tls = acceptor.accept(plain.into_inner()).await.map_err(|e| ConnError::Tls(e.to_string()))?;
                    let mut tls = BufReader::with_capacity(READ_BUFFER_BYTES, tls);
                    let outcome = self.options(&mut tls, no_zeroes, TlsState::Established, &mut options_left).await?;
                    Ok::<_, ConnError>((tls, outcome))
                })
                .await
                .map_err(timed_out)??;
                match outcome {
                    Handshake::Abort => Ok(()),
                    Handshake::Transmission(dev) => self.transmission(tls, dev).await,
                    Handshake::StartTls => Err(ConnError::Protocol("STARTTLS twice".into())),
                }
            }
        }
    }

    // ---- Handshake ---------------------------------------------------------------------------

    /// Sends the greeting and reads the client's flags; returns whether it asked for NO_ZEROES.
    async fn greeting<S>(&self, s: &mut S) -> Result<bool, ConnError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        s.write_all(&encode_greeting()).await?;
        let mut flag_bytes = [0u8; 4];
        s.read_exact(&mut flag_bytes).await?;
        let client_flags = parse_client_flags(&flag_bytes)?;
        Ok(client_flags & NBD_FLAG_C_NO_ZEROES != 0)
    }

    /// The option haggling, until the client picks an export, aborts, or (in state
    /// `Required`) upgrades to TLS. `options_left` counts down across the upgrade.
    async fn options<S>(&self, s: &mut S, no_zeroes: bool, tls: TlsState, options_left: &mut u32) -> Result<Handshake<E::Dev>, ConnError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        while *options_left > 0 {
            *options_left -= 1;
            let mut header_bytes = [0u8; OPTION_HEADER_BYTES];
            s.read_exact(&mut header_bytes).await?;
            let header = parse_option_header(&header_bytes)?;
            let option = header.option;

            if header.length_bytes > self.config.max_option_bytes {
                if option == NBD_OPT_EXPORT_NAME {
                    return Err(ConnError::Protocol(format!(
                        "EXPORT_NAME of {} bytes is over max_option_bytes",
                        header.length_bytes
                    )));
                }
                discard(
                    s,
                    header.length_bytes,
                    self.config.max_discard_payload_bytes,
                )
                .await?;
                let msg = format!(
                    "option data of {} bytes exceeds the server's limit of {} bytes",
                    header.length_bytes, self.config.max_option_bytes
                );
                s.write_all(&encode_option_reply(
                    option,
                    NBD_REP_ERR_TOO_BIG,
                    msg.as_bytes(),
                ))
                .await?;
                continue;
            }
            let mut data = vec![0u8; header.length_bytes as usize];
            s.read_exact(&mut data).await?;

            match tls_gate(tls, option, header.length_bytes) {
                TlsGate::Serve => {}
                TlsGate::StartTls => {
                    s.write_all(&encode_option_reply(option, NBD_REP_ACK, &[])).await?;
                    s.flush().await?;
                    return Ok(Handshake::StartTls);
                }
                TlsGate::Refuse(reply, msg) => {
                    s.write_all(&encode_option_reply(option, reply, msg.as_bytes())).await?;
                    continue;
                }
                TlsGate::Close(why) => return Err(ConnError::Protocol(why.into())),
            }

            match option {
                NBD_OPT_EXPORT_NAME => {
                    // No error reply exists for this option: an unknown name closes the connection.
                    let name = parse_export_name(&data)?;
                    let dev = self
                        .exports
                        .open(&name)
                        .await
                        .map_err(ConnError::Protocol)?;
                    let size = dev.size_bytes();
                    s.write_all(&encode_export_name_reply(
                        size,
                        TRANSMISSION_FLAGS,
                        no_zeroes,
                    ))
                    .await?;
                    debug!("nbd: EXPORT_NAME {name:?} ({size} bytes)");
                    return Ok(Handshake::Transmission(dev));
                }
                NBD_OPT_ABORT => {
                    // The client may already have closed: an error sending the ACK is no matter.
                    let _ = s
                        .write_all(&encode_option_reply(option, NBD_REP_ACK, &[]))
                        .await;
                    return Ok(Handshake::Abort);
                }
                NBD_OPT_LIST => {
                    if !data.is_empty() {
                        let msg = b"NBD_OPT_LIST takes no data";
                        s.write_all(&encode_option_reply(option, NBD_REP_ERR_INVALID, msg))
                            .await?;
                        continue;
                    }
                    let mut out = Vec::new();
                    for name in self.exports.list().await {
                        let mut entry = (name.len() as u32).to_be_bytes().to_vec();
                        entry.extend_from_slice(name.as_bytes());
                        out.extend(encode_option_reply(option, NBD_REP_SERVER, &entry));
                    }
                    out.extend(encode_option_reply(option, NBD_REP_ACK, &[]));
                    s.write_all(&out).await?;
                }
                NBD_OPT_INFO | NBD_OPT_GO => {
                    let request = match parse_info_request(&data) {
                        Ok(r) => r,
                        Err(e) => {
                            let msg = e.to_string();
                            s.write_all(&encode_option_reply(
                                option,
                                NBD_REP_ERR_INVALID,
                                msg.as_bytes(),
                            ))
                            .await?;
                            continue;
                        }
                    };
                    let dev = match self.exports.open(&request.name).await {
                        Ok(dev) => dev,
                        Err(msg) => {
                            s.write_all(&encode_option_reply(
                                option,
                                NBD_REP_ERR_UNKNOWN,
                                msg.as_bytes(),
                            ))
                            .await?;
                            continue;
                        }
                    };
                    s.write_all(&self.info_replies(option, &request, dev.size_bytes()))
                        .await?;
                    if option == NBD_OPT_GO {
                        debug!("nbd: GO {:?} ({} bytes)", request.name, dev.size_bytes());
                        return Ok(Handshake::Transmission(dev));
                    }
                }
                // STRUCTURED_REPLY, META_CONTEXT, EXTENDED_HEADERS and anything newer (STARTTLS
                // was answered by the TLS gate above).
                _ => {
                    let msg = format!("option {option} is not supported by this server");
                    s.write_all(&encode_option_reply(
                        option,
                        NBD_REP_ERR_UNSUP,
                        msg.as_bytes(),
                    ))
                    .await?;
                }
            }
        }
        Err(ConnError::Protocol(format!(
            "more than {} options in one handshake (max_options_per_handshake)",
            self.config.max_options_per_handshake
        )))
    }

    /// NBD_REP_INFO replies for an INFO/GO, then the ACK.
    fn info_replies(&self, option: u32, request: &InfoRequest, size_bytes: u64) -> Vec<u8> {
        let mut out = encode_option_reply(
            option,
            NBD_REP_INFO,
            &encode_info_export(size_bytes, TRANSMISSION_FLAGS),
        );
        // Sent whether asked or not (the spec allows it); minimum 1 means "any alignment".
        let block_size = encode_info_block_size(
            1,
            self.config.preferred_block_bytes,
            self.config.max_request_bytes,
        );
        out.extend(encode_option_reply(option, NBD_REP_INFO, &block_size));
        if request.info_types.contains(&NBD_INFO_NAME) {
            let mut name_info = NBD_INFO_NAME.to_be_bytes().to_vec();
            name_info.extend_from_slice(request.name.as_bytes());
            out.extend(encode_option_reply(option, NBD_REP_INFO, &name_info));
        }
        out.extend(encode_option_reply(option, NBD_REP_ACK, &[]));
        out
    }

    // ---- Transmission ------------------------------------------------------------------------

    async fn transmission<S>(&self, stream: BufReader<S>, dev: Arc<E::Dev>) -> Result<(), ConnError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let size_bytes = dev.size_bytes();
        let limits = RequestLimits {
            max_request_bytes: self.config.max_request_bytes,
            max_discard_payload_bytes: self.config.max_discard_payload_bytes,
        };
        let max_requests = self.config.max_in_flight_requests_per_connection as usize;
        let request_slots = Arc::new(Semaphore::new(max_requests));
        let buffer_bytes = Arc::new(Semaphore::new(
            self.config.max_in_flight_bytes_per_connection as usize,
        ));
        // Every queued reply holds a request slot, so this channel never fills beyond them.
        let (reply_tx, reply_rx) = mpsc::channel::<Outgoing>(max_requests);

        let (mut reader, writer) = tokio::io::split(stream);
        let writer_task = tokio::spawn(write_replies(writer, reply_rx));

        let result: Result<(), ConnError> = async {
            loop {
                let mut header_bytes = [0u8; REQUEST_HEADER_BYTES];
                tokio::select! {
                    read = read_header(&mut reader, &mut header_bytes) => {
                        if !read? {
                            // The client closed its side between requests without NBD_CMD_DISC:
                            // treat it as one, so the replies in flight still go out.
                            return Ok(());
                        }
                    }
                    _ = reply_tx.closed() => return Err(ConnError::Protocol("reply writer failed".into())),
                }
                let header = parse_request_header(&header_bytes)?;
                let slot = request_slots.clone().acquire_owned().await.expect("semaphore never closed");
                match plan_request(&header, size_bytes, &limits) {
                    RequestPlan::Execute(command) => {
                        let buffer_len = match command {
                            Command::Read { length_bytes, .. } | Command::Write { length_bytes, .. } => length_bytes,
                            _ => 0,
                        };
                        let buffer = if buffer_len > 0 {
                            Some(buffer_bytes.clone().acquire_many_owned(buffer_len).await.expect("never closed"))
                        } else {
                            None
                        };
                        let payload = if let Command::Write { length_bytes, .. } = command {
                            self.read_payload(&mut reader, length_bytes).await?
                        } else {
                            Vec::new()
                        };
                        let reply = ReplySlot {
                            cookie: header.cookie,
                            tx: reply_tx.clone(),
                            permits: Some((slot, buffer)),
                        };
                        tokio::spawn(run_command(dev.clone(), command, payload, reply));
                    }
                    RequestPlan::Reject { errno, discard_payload_bytes } => {
                        debug!("nbd: rejecting {header:?} with errno {errno}");
                        discard(&mut reader, discard_payload_bytes, limits.max_discard_payload_bytes).await?;
                        let reply = ReplySlot { cookie: header.cookie, tx: reply_tx.clone(), permits: Some((slot, None)) };
                        reply.send(errno, Vec::new()).await;
                    }
                    RequestPlan::Disconnect => return Ok(()), // NBD_CMD_DISC
                    RequestPlan::Close(reason) => return Err(ConnError::Protocol(reason)),
                }
            }
        }
        .await;

        drop(reply_tx);
        match result {
            Ok(()) => {
                // Disconnect: the requests in flight finish and their replies go out first.
                match writer_task.await {
                    Ok(Ok(())) | Err(_) => Ok(()),
                    Ok(Err(e)) => Err(e.into()),
                }
            }
            Err(e) => {
                // The device I/O already started still completes; its replies are dropped.
                writer_task.abort();
                Err(e)
            }
        }
    }
}

impl<E: Exports> Server<E> {
    /// Reads a WRITE payload of `len` bytes within the server-wide budget of bytes held for
    /// incomplete requests (waiting for room first) and the payload timeout.
    async fn read_payload<R: AsyncRead + Unpin>(&self, reader: &mut R, len: u32) -> Result<Vec<u8>, ConnError> {
        // Held only while the payload is being received: once complete, the request's bytes
        // count against the connection's own in-flight limit.
        let _budget = self.incomplete_bytes.acquire_many(len).await.expect("never closed");
        let timeout_ms = self.config.request_payload_timeout_ms;
        let mut data = vec![0u8; len as usize];
        tokio::time::timeout(Duration::from_millis(timeout_ms), reader.read_exact(&mut data))
            .await
            .map_err(|_| ConnError::Protocol(format!("a {len}-byte WRITE payload did not arrive within {timeout_ms} ms")))??;
        Ok(data)
    }
}

enum Handshake<D> {
    Transmission(Arc<D>),
    Abort,
    /// The client asked for TLS and was acknowledged: the TLS handshake comes next.
    StartTls,
}

/// Fills `buf` from `r`; returns false on end of stream before the first byte (a clean close
/// between requests). End of stream inside the header is an error.
async fn read_header<R: AsyncRead + Unpin>(r: &mut R, buf: &mut [u8]) -> io::Result<bool> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]).await? {
            0 if filled == 0 => return Ok(false),
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => filled += n,
        }
    }
    Ok(true)
}

/// Reads and throws away `len` bytes, `DISCARD_CHUNK_BYTES` at a time.
async fn discard<R: AsyncRead + Unpin>(r: &mut R, len: u32, max_len: u32) -> Result<(), ConnError> {
    if len > max_len {
        return Err(ConnError::Protocol(format!(
            "cannot skip {len} bytes (limit {max_len})"
        )));
    }
    let mut left = len as usize;
    let mut chunk = vec![0u8; DISCARD_CHUNK_BYTES.min(left)];
    while left > 0 {
        let n = left.min(chunk.len());
        r.read_exact(&mut chunk[..n]).await?;
        left -= n;
    }
    Ok(())
}

/// A reply on its way to the writer, holding the request's slot and buffer bytes until written.
struct Outgoing {
    header: [u8; SIMPLE_REPLY_HEADER_BYTES],
    data: Vec<u8>,
    _permits: Permits,
}

type Permits = (OwnedSemaphorePermit, Option<OwnedSemaphorePermit>);

/// The obligation to reply to one request. If dropped unsent (the task panicked or was
/// cancelled), it replies EIO so the client is not left waiting.
struct ReplySlot {
    cookie: u64,
    tx: mpsc::Sender<Outgoing>,
    permits: Option<Permits>,
}

impl ReplySlot {
    async fn send(mut self, errno: u32, data: Vec<u8>) {
        let permits = self.permits.take().expect("a reply is sent once");
        let out = Outgoing {
            header: encode_simple_reply(errno, self.cookie),
            data,
            _permits: permits,
        };
        // An error means the writer is gone: the connection is closing and the reply moot.
        let _ = self.tx.send(out).await;
    }
}

impl Drop for ReplySlot {
    fn drop(&mut self) {
        if let Some(permits) = self.permits.take() {
            // Cannot be full: every queued reply holds one of the slots, and we hold another.
            let out = Outgoing {
                header: encode_simple_reply(NBD_EIO, self.cookie),
                data: Vec::new(),
                _permits: permits,
            };
            let _ = self.tx.try_send(out);
        }
    }
}

async fn run_command<D: BlockDev>(
    dev: Arc<D>,
    command: Command,
    payload: Vec<u8>,
    reply: ReplySlot,
) {
    // FUA needs nothing extra: a BlockDev write is durable when it completes.
    let result: Result<Vec<u8>, DevError> = match command {
        Command::Read {
            offset,
            length_bytes,
        } => match dev.read(offset, length_bytes).await {
            Ok(data) if data.len() == length_bytes as usize => Ok(data),
            Ok(data) => Err(DevError::Io(format!(
                "device returned {} bytes for a {length_bytes}-byte read",
                data.len()
            ))),
            Err(e) => Err(e),
        },
        Command::Write { offset, .. } => dev.write(offset, payload).await.map(|()| Vec::new()),
        Command::Flush => dev.flush().await.map(|()| Vec::new()),
        Command::Trim {
            offset,
            length_bytes,
            ..
        } => dev
            .trim(offset, length_bytes as u64)
            .await
            .map(|()| Vec::new()),
        Command::WriteZeroes {
            offset,
            length_bytes,
            ..
        } => dev
            .write_zeroes(offset, length_bytes as u64)
            .await
            .map(|()| Vec::new()),
    };
    match result {
        Ok(data) => reply.send(0, data).await,
        Err(e) => {
            debug!("nbd: {command:?} failed: {e}");
            reply.send(errno_for(&e), Vec::new()).await
        }
    }
}

/// The one writer of a connection: writes replies in the order they complete, flushing when no
/// more are queued. Ends when every sender (the reader and each request task) is gone.
async fn write_replies<W: AsyncWrite + Unpin>(
    w: W,
    mut rx: mpsc::Receiver<Outgoing>,
) -> io::Result<()> {
    let mut w = BufWriter::with_capacity(WRITE_BUFFER_BYTES, w);
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        while let Some(out) = next {
            w.write_all(&out.header).await?;
            w.write_all(&out.data).await?;
            drop(out);
            next = rx.try_recv().ok();
        }
        w.flush().await?;
    }
    let _ = w.shutdown().await;
    Ok(())
}
