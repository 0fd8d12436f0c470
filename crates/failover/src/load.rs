//! Load generator and checker for the SQLite front (`apps/sqlite_front.py`) and for PostgreSQL
//! (table `commits(id bigint primary key, payload text)`, autocommit inserts), from the
//! client's side of the endpoint.
//!
//! One client inserts fresh ids one at a time (`INSERT <id>`), records every acknowledged id
//! with its time, reconnects after any error (a retried request always gets a new id, so an
//! unacknowledged attempt can never be confused with an acknowledged one). The outage is the
//! longest gap between two acknowledgements: when throughput dropped to zero and when it
//! resumed. [`verify`] then reads the table through the endpoint: every acknowledged id must be
//! there, and nothing that was never attempted.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// The SQLite front's script (run with `python3 -c`).
pub const SQLITE_FRONT_PY: &str = include_str!("../apps/sqlite_front.py");

/// What the load talks to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Target {
    /// The SQLite front's one-line protocol.
    #[default]
    Line,
    /// PostgreSQL (trust authentication).
    Postgres(crate::spec::PgTarget),
    /// MySQL/MariaDB (empty password); the table is `understudy.commits`, RocksDB if the
    /// server's default engine is.
    Mysql(crate::spec::MyTarget),
}

/// Bytes of payload per PostgreSQL row (the SQLite front's default too).
pub const PG_PAYLOAD_BYTES: usize = 200;

enum Conn {
    Line(BufReader<TcpStream>),
    Pg(crate::pg::PgConn),
    My(crate::mysql::MyConn),
}

async fn connect(endpoint: SocketAddr, target: &Target) -> std::io::Result<Conn> {
    match target {
        Target::Line => {
            let s = tokio::time::timeout(SETUP_TIMEOUT, TcpStream::connect(endpoint))
                .await
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))??;
            let _ = s.set_nodelay(true);
            Ok(Conn::Line(BufReader::new(s)))
        }
        Target::Postgres(pg) => {
            let mut c = crate::pg::PgConn::connect(endpoint, &pg.user, &pg.database, SETUP_TIMEOUT).await.map_err(std::io::Error::other)?;
            c.query(&format!("CREATE TABLE IF NOT EXISTS commits(id bigint PRIMARY KEY, payload text NOT NULL DEFAULT repeat('x', {PG_PAYLOAD_BYTES}))"))
                .await
                .map_err(std::io::Error::other)?;
            Ok(Conn::Pg(c))
        }
        Target::Mysql(my) => {
            let mut c = crate::mysql::MyConn::connect(endpoint, &my.user, SETUP_TIMEOUT).await.map_err(std::io::Error::other)?;
            c.query("CREATE DATABASE IF NOT EXISTS understudy").await.map_err(std::io::Error::other)?;
            c.query("CREATE TABLE IF NOT EXISTS understudy.commits(id bigint PRIMARY KEY, payload varchar(255) NOT NULL)")
                .await
                .map_err(std::io::Error::other)?;
            Ok(Conn::My(c))
        }
    }
}

/// Inserts `id`; Ok only when the commit was acknowledged (within [`REQUEST_TIMEOUT`]).
async fn insert(conn: &mut Conn, id: u64) -> std::io::Result<()> {
    let fut = async {
        match conn {
            Conn::Line(c) => match request(c, &format!("INSERT {id}"), REQUEST_TIMEOUT).await? {
                r if r == format!("OK {id}") => Ok(()),
                r => Err(std::io::Error::other(format!("unexpected reply {r:?}"))),
            },
            Conn::Pg(c) => c.query(&format!("INSERT INTO commits(id) VALUES ({id})")).await.map(|_| ()).map_err(std::io::Error::other),
            Conn::My(c) => c
                .query(&format!("INSERT INTO understudy.commits VALUES ({id}, REPEAT('x', {PG_PAYLOAD_BYTES}))"))
                .await
                .map(|_| ())
                .map_err(std::io::Error::other),
        }
    };
    tokio::time::timeout(REQUEST_TIMEOUT, fut).await.map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "request timed out"))?
}

async fn list(conn: &mut Conn) -> std::io::Result<BTreeSet<u64>> {
    match conn {
        Conn::Line(c) => {
            let r = request(c, "LIST", SETUP_TIMEOUT).await?;
            if !r.starts_with("IDS") {
                return Err(std::io::Error::other(format!("unexpected reply {:?}", &r[..r.len().min(100)])));
            }
            Ok(r.trim_start_matches("IDS").trim().split(',').filter(|s| !s.is_empty()).filter_map(|s| s.parse().ok()).collect())
        }
        Conn::Pg(c) => {
            let rows = c.query("SELECT id FROM commits").await.map_err(std::io::Error::other)?;
            Ok(rows.iter().filter_map(|r| r.first().cloned().flatten()).filter_map(|s| s.parse().ok()).collect())
        }
        Conn::My(c) => {
            let rows = c.query("SELECT id FROM understudy.commits").await.map_err(std::io::Error::other)?;
            Ok(rows.iter().filter_map(|r| r.first().cloned().flatten()).filter_map(|s| s.parse().ok()).collect())
        }
    }
}

/// How long one insert may take before its connection is abandoned and a new one made (with
/// a new id). Short: a request sent into a link that went silent (a cut, a fenced primary)
/// would otherwise keep the client away from a primary that is back, or newly promoted, for the
/// whole timeout — the client's outage would outlast the failover. A commit on this machine
/// takes milliseconds; one that takes longer is only retried (it may still commit: an
/// unacknowledged id may or may not be present, never counted as acknowledged).
pub const REQUEST_TIMEOUT: Duration = Duration::from_millis(1_000);
/// Connecting and setting up a session (PostgreSQL and MariaDB: log in, create the table), and
/// reading the whole table back in [`verify`].
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause before reconnecting after an error.
pub const RECONNECT_PAUSE: Duration = Duration::from_millis(20);
/// Largest reply line accepted (LIST of many ids).
pub const MAX_REPLY_BYTES: usize = 64 << 20;

#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct LoadResult {
    /// Acknowledged ids with the time of the acknowledgement (ms since the start).
    pub acked: Vec<(u64, u64)>,
    /// Ids sent (acknowledged or not) are first_id..=attempted_max (first_id comes from the
    /// clock, so runs against one table never collide).
    pub first_id: u64,
    pub attempted_max: u64,
    pub errors: u64,
    pub duration_ms: u64,
    /// The longest time without an acknowledgement, and when it began and ended (ms).
    pub max_gap_ms: u64,
    pub gap_start_ms: u64,
    pub gap_end_ms: u64,
    /// Acknowledgements per window of `window_ms`.
    pub window_ms: u64,
    pub ops_per_window: Vec<u64>,
}

async fn request(conn: &mut BufReader<TcpStream>, line: &str, timeout: Duration) -> std::io::Result<String> {
    let fut = async {
        conn.get_mut().write_all(format!("{line}\n").as_bytes()).await?;
        let mut reply = String::new();
        let n = conn.read_line(&mut reply).await?;
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed"));
        }
        if reply.len() > MAX_REPLY_BYTES {
            return Err(std::io::Error::other("reply too long"));
        }
        Ok(reply.trim_end().to_string())
    };
    tokio::time::timeout(timeout, fut).await.map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "request timed out"))?
}

/// Inserts until `stop` resolves (or `duration` passes).
pub async fn run_load(
    endpoint: SocketAddr,
    target: &Target,
    duration: Duration,
    window_ms: u64,
    stop: impl std::future::Future<Output = ()>,
) -> LoadResult {
    run_load_observed(endpoint, target, duration, window_ms, stop, |_, _| {}).await
}

/// [`run_load`], calling `on_ack(acknowledged so far, ms since the start)` after every
/// acknowledged commit (progress for whoever drives a failure from the client's view).
pub async fn run_load_observed(
    endpoint: SocketAddr,
    target: &Target,
    duration: Duration,
    window_ms: u64,
    stop: impl std::future::Future<Output = ()>,
    mut on_ack: impl FnMut(usize, u64),
) -> LoadResult {
    let start = Instant::now();
    let mut r = LoadResult { window_ms, ..Default::default() };
    let mut conn: Option<Conn> = None;
    let first_id = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(1) * 1000;
    r.first_id = first_id;
    r.attempted_max = first_id - 1;
    let mut next_id = first_id;
    let mut last_ack_ms = 0u64;
    tokio::pin!(stop);
    let body = async {
        while start.elapsed() < duration {
            if conn.is_none() {
                match connect(endpoint, target).await {
                    Ok(c) => conn = Some(c),
                    Err(_) => {
                        r.errors += 1;
                        tokio::time::sleep(RECONNECT_PAUSE).await;
                        continue;
                    }
                }
            }
            let id = next_id;
            next_id += 1;
            r.attempted_max = id;
            match insert(conn.as_mut().unwrap(), id).await {
                Ok(()) => {
                    let t = start.elapsed().as_millis() as u64;
                    r.acked.push((id, t));
                    on_ack(r.acked.len(), t);
                    if t - last_ack_ms > r.max_gap_ms {
                        r.max_gap_ms = t - last_ack_ms;
                        r.gap_start_ms = last_ack_ms;
                        r.gap_end_ms = t;
                    }
                    last_ack_ms = t;
                    let w = (t / window_ms.max(1)) as usize;
                    if r.ops_per_window.len() <= w {
                        r.ops_per_window.resize(w + 1, 0);
                    }
                    r.ops_per_window[w] += 1;
                }
                _ => {
                    r.errors += 1;
                    conn = None;
                    tokio::time::sleep(RECONNECT_PAUSE).await;
                }
            }
        }
    };
    tokio::select! {
        _ = body => {}
        _ = &mut stop => {}
    }
    r.duration_ms = start.elapsed().as_millis() as u64;
    // A gap still open at the end counts too.
    let end_gap = r.duration_ms - last_ack_ms;
    if end_gap > r.max_gap_ms {
        r.max_gap_ms = end_gap;
        r.gap_start_ms = last_ack_ms;
        r.gap_end_ms = r.duration_ms;
    }
    r
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Verdict {
    pub acked: usize,
    pub present: usize,
    /// Acknowledged but not in the table (lost writes): must be empty.
    pub missing: Vec<u64>,
    /// In the table but never attempted by this run (ids from its range only): must be empty.
    pub unexpected: Vec<u64>,
}

/// Reads every id through the endpoint (retrying until `timeout`) and checks the load's record.
pub async fn verify(endpoint: SocketAddr, target: &Target, load: &LoadResult, timeout: Duration) -> Result<Verdict, String> {
    let deadline = Instant::now() + timeout;
    let present = loop {
        let attempt = async {
            let mut c = connect(endpoint, target).await?;
            list(&mut c).await
        };
        match attempt.await {
            Ok(ids) => break ids,
            other => {
                if Instant::now() > deadline {
                    return Err(format!("cannot read the table through {endpoint}: {other:?}"));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let acked: BTreeSet<u64> = load.acked.iter().map(|(id, _)| *id).collect();
    Ok(Verdict {
        acked: acked.len(),
        present: present.len(),
        missing: acked.difference(&present).copied().take(100).collect(),
        unexpected: present.iter().copied().filter(|id| *id >= load.first_id && *id > load.attempted_max).take(100).collect(),
    })
}
