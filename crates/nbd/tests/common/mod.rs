//! Helpers shared by the integration tests: an in-process server on its own runtime, a minimal
//! NBD client, test devices, and a way to run real client tools with a timeout.
#![allow(dead_code)]

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blockdev::{BlockDev, DevError, DevResult, MemDev};
use nbd::proto::*;
use nbd::{Exports, Server, ServerConfig};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// A server running on its own multi-threaded runtime (so tests may block freely).
pub struct TestServer {
    pub addr: SocketAddr,
    pub runtime: tokio::runtime::Runtime,
}

impl TestServer {
    pub fn start<E: Exports>(exports: E) -> Self {
        Self::start_with(exports, ServerConfig::default())
    }

    pub fn start_with<E: Exports>(exports: E, config: ServerConfig) -> Self {
        Self::start_server(Server::with_config(exports, config))
    }

    /// Serves a server built by the test (e.g. one that requires TLS).
    pub fn start_server<E: Exports>(server: Server<E>) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().unwrap();
        runtime.spawn(Arc::new(server).serve_tcp(listener));
        TestServer { addr, runtime }
    }

    pub fn uri(&self, name: &str) -> String {
        format!("nbd://127.0.0.1:{}/{}", self.addr.port(), name)
    }
}

/// A device that wraps a MemDev and can be told to fail writes with a given error.
pub struct FaultyDev {
    pub inner: MemDev,
    pub fail_writes: std::sync::Mutex<Option<DevError>>,
    pub refuse_all_writes: AtomicBool,
}

impl FaultyDev {
    pub fn new(size_bytes: u64) -> Self {
        FaultyDev {
            inner: MemDev::new(size_bytes),
            fail_writes: std::sync::Mutex::new(None),
            refuse_all_writes: AtomicBool::new(false),
        }
    }
    fn write_error(&self) -> Option<DevError> {
        if self.refuse_all_writes.load(Ordering::SeqCst) {
            return Some(DevError::WriteRefused("volume fenced".into()));
        }
        self.fail_writes.lock().unwrap().clone()
    }
}

impl BlockDev for FaultyDev {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    async fn read(&self, offset: u64, len: u32) -> DevResult<Vec<u8>> {
        self.inner.read(offset, len).await
    }
    async fn write(&self, offset: u64, data: Vec<u8>) -> DevResult<()> {
        match self.write_error() {
            Some(e) => Err(e),
            None => self.inner.write(offset, data).await,
        }
    }
    async fn flush(&self) -> DevResult<()> {
        self.inner.flush().await
    }
    async fn trim(&self, offset: u64, len: u64) -> DevResult<()> {
        match self.write_error() {
            Some(e) => Err(e),
            None => self.inner.trim(offset, len).await,
        }
    }
    async fn write_zeroes(&self, offset: u64, len: u64) -> DevResult<()> {
        match self.write_error() {
            Some(e) => Err(e),
            None => self.inner.write_zeroes(offset, len).await,
        }
    }
}

// ---- A minimal async client ------------------------------------------------------------------

pub async fn read_option_reply<S: AsyncRead + Unpin>(s: &mut S) -> std::io::Result<OptionReply> {
    let mut head = [0u8; 20];
    s.read_exact(&mut head).await?;
    let len = u32::from_be_bytes(head[16..20].try_into().unwrap()) as usize;
    let mut all = head.to_vec();
    all.resize(20 + len, 0);
    s.read_exact(&mut all[20..]).await?;
    let (reply, _) = parse_option_reply(&all).map_err(std::io::Error::other)?;
    Ok(reply)
}

pub async fn send_option<S: AsyncWrite + Unpin>(
    s: &mut S,
    option: u32,
    data: &[u8],
) -> std::io::Result<()> {
    let mut out = encode_option_header(&OptionHeader {
        option,
        length_bytes: data.len() as u32,
    })
    .to_vec();
    out.extend_from_slice(data);
    s.write_all(&out).await
}

/// Reads the greeting and sends the client flags; returns the handshake flags.
pub async fn greet<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    client_flags: u32,
) -> std::io::Result<u16> {
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).await?;
    assert_eq!(&greeting[0..8], b"NBDMAGIC");
    assert_eq!(&greeting[8..16], b"IHAVEOPT");
    s.write_all(&client_flags.to_be_bytes()).await?;
    Ok(u16::from_be_bytes([greeting[16], greeting[17]]))
}

pub struct Client {
    pub stream: TcpStream,
    pub size_bytes: u64,
    pub transmission_flags: u16,
    next_cookie: u64,
}

impl Client {
    /// Connects and negotiates `name` with NBD_OPT_GO.
    pub async fn connect(addr: SocketAddr, name: &str) -> Result<Client, String> {
        let mut s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        greet(&mut s, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES)
            .await
            .map_err(|e| e.to_string())?;
        let req = InfoRequest {
            name: name.into(),
            info_types: vec![NBD_INFO_BLOCK_SIZE],
        };
        send_option(&mut s, NBD_OPT_GO, &encode_info_request(&req))
            .await
            .map_err(|e| e.to_string())?;
        let mut size_bytes = None;
        let mut flags = 0;
        loop {
            let r = read_option_reply(&mut s).await.map_err(|e| e.to_string())?;
            match r.reply_type {
                NBD_REP_INFO => {
                    let kind = u16::from_be_bytes([r.data[0], r.data[1]]);
                    if kind == NBD_INFO_EXPORT {
                        size_bytes = Some(u64::from_be_bytes(r.data[2..10].try_into().unwrap()));
                        flags = u16::from_be_bytes([r.data[10], r.data[11]]);
                    }
                }
                NBD_REP_ACK => break,
                other => {
                    return Err(format!(
                        "GO failed: reply {other:#x}: {}",
                        String::from_utf8_lossy(&r.data)
                    ))
                }
            }
        }
        Ok(Client {
            stream: s,
            size_bytes: size_bytes.ok_or("no NBD_INFO_EXPORT")?,
            transmission_flags: flags,
            next_cookie: 1,
        })
    }

    pub async fn send_request(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> u64 {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let h = RequestHeader {
            flags,
            kind,
            cookie,
            offset,
            length,
        };
        let mut out = encode_request_header(&h).to_vec();
        out.extend_from_slice(payload);
        self.stream.write_all(&out).await.expect("send request");
        cookie
    }

    /// Reads one simple reply; `read_len` is the data length expected if it succeeded.
    pub async fn read_reply(&mut self, read_len: usize) -> std::io::Result<(u32, u64, Vec<u8>)> {
        let mut head = [0u8; SIMPLE_REPLY_HEADER_BYTES];
        self.stream.read_exact(&mut head).await?;
        let (errno, cookie) = parse_simple_reply(&head).map_err(std::io::Error::other)?;
        let mut data = vec![0u8; if errno == 0 { read_len } else { 0 }];
        self.stream.read_exact(&mut data).await?;
        Ok((errno, cookie, data))
    }

    /// One request, one reply: returns `(errno, data)`.
    pub async fn call(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> (u32, Vec<u8>) {
        let cookie = self
            .send_request(kind, flags, offset, length, payload)
            .await;
        let read_len = if kind == NBD_CMD_READ {
            length as usize
        } else {
            0
        };
        let (errno, got_cookie, data) = self.read_reply(read_len).await.expect("reply");
        assert_eq!(got_cookie, cookie);
        (errno, data)
    }

    pub async fn write(&mut self, offset: u64, data: &[u8]) -> u32 {
        self.call(NBD_CMD_WRITE, 0, offset, data.len() as u32, data)
            .await
            .0
    }

    pub async fn read(&mut self, offset: u64, len: u32) -> Result<Vec<u8>, u32> {
        match self.call(NBD_CMD_READ, 0, offset, len, &[]).await {
            (0, data) => Ok(data),
            (errno, _) => Err(errno),
        }
    }

    pub async fn disconnect(mut self) {
        self.send_request(NBD_CMD_DISC, 0, 0, 0, &[]).await;
        let mut rest = Vec::new();
        let _ =
            tokio::time::timeout(Duration::from_secs(5), self.stream.read_to_end(&mut rest)).await;
    }
}

/// True if the peer has closed `s` (EOF or reset) within `timeout`.
pub async fn is_closed(s: &mut TcpStream, timeout: Duration) -> bool {
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

// ---- Running real client tools ---------------------------------------------------------------

pub struct ToolOutput {
    pub status_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl ToolOutput {
    pub fn success(&self) -> bool {
        self.status_code == Some(0)
    }
    pub fn all(&self) -> String {
        format!(
            "exit {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status_code, self.stdout, self.stderr
        )
    }
}

/// Panics with a clear message if `tool` is not on PATH.
pub fn require_tool(tool: &str, package: &str) {
    let found = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|p| p.join(tool).is_file()))
        .unwrap_or(false);
    assert!(found, "`{tool}` is not installed: this test needs it (Debian package `{package}`: apt-get install {package})");
}

/// Runs a command, killing it (by its PID) after `timeout`. Panics if it cannot start.
pub fn run_with_timeout(cmd: &mut Command, timeout: Duration) -> ToolOutput {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let mut out_pipe = child.stdout.take().unwrap();
    let mut err_pipe = child.stderr.take().unwrap();
    let out_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out_pipe.read_to_string(&mut s);
        s
    });
    let err_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err_pipe.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break Some(status);
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = out_thread.join().unwrap_or_default();
    let stderr = err_thread.join().unwrap_or_default();
    if status.is_none() {
        panic!("{cmd:?} did not finish within {timeout:?}; killed.\nstdout: {stdout}\nstderr: {stderr}");
    }
    ToolOutput {
        status_code: status.and_then(|s| s.code()),
        stdout,
        stderr,
    }
}

/// A MemDev whose reads and writes take `delay` and which records how many ran at once.
pub struct LatencyDev {
    pub inner: MemDev,
    pub delay: Duration,
    pub in_flight: std::sync::atomic::AtomicU64,
    pub max_in_flight: std::sync::atomic::AtomicU64,
}

impl LatencyDev {
    pub fn new(size_bytes: u64, delay: Duration) -> Self {
        LatencyDev {
            inner: MemDev::new(size_bytes),
            delay,
            in_flight: 0.into(),
            max_in_flight: 0.into(),
        }
    }
    async fn slow<T>(&self, io: impl std::future::Future<Output = T>) -> T {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(self.delay).await;
        let out = io.await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        out
    }
}

impl BlockDev for LatencyDev {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    async fn read(&self, offset: u64, len: u32) -> DevResult<Vec<u8>> {
        self.slow(self.inner.read(offset, len)).await
    }
    async fn write(&self, offset: u64, data: Vec<u8>) -> DevResult<()> {
        self.slow(self.inner.write(offset, data)).await
    }
    async fn flush(&self) -> DevResult<()> {
        self.inner.flush().await
    }
    async fn trim(&self, offset: u64, len: u64) -> DevResult<()> {
        self.inner.trim(offset, len).await
    }
    async fn write_zeroes(&self, offset: u64, len: u64) -> DevResult<()> {
        self.inner.write_zeroes(offset, len).await
    }
}
