//! The health probes of an instance (the spec's `[health]`): a command, a PostgreSQL or
//! MySQL/MariaDB query ([`crate::pg`], [`crate::mysql`]), or a line sent over TCP and the
//! answer's first characters checked. Each probe is bounded by the spec's `timeout_ms`; the
//! monitor's `Ping` action runs one.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::proto::InstanceId;
use crate::spec::{substitute, HealthSpec};

/// One health check of an instance at `addr` (its network link): the spec's probe, bounded by
/// its `timeout_ms`; true if it passed.
pub async fn health_check(h: &HealthSpec, addr: SocketAddr, instance: InstanceId) -> bool {
    let timeout = Duration::from_millis(h.timeout_ms);
    if let Some(cmd) = &h.command {
        let args: Vec<String> = cmd.iter().map(|a| substitute(a, Path::new(""), addr.ip(), addr.port(), &instance.to_string())).collect();
        let run = tokio::process::Command::new(&args[0])
            .args(&args[1..])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .status();
        return matches!(tokio::time::timeout(timeout, run).await, Ok(Ok(s)) if s.success());
    }
    let sql = h.send.as_deref().unwrap_or("SELECT 1");
    let check = async {
        if let Some(pg) = &h.postgres {
            let mut c = crate::pg::PgConn::connect(addr, &pg.user, &pg.database, timeout).await.ok()?;
            let rows = c.query(sql).await.ok()?;
            c.close().await;
            first_cell_expected(&rows, h.expect.as_deref())
        } else if let Some(my) = &h.mysql {
            let mut c = crate::mysql::MyConn::connect(addr, &my.user, timeout).await.ok()?;
            let rows = c.query(sql).await.ok()?;
            c.close().await;
            first_cell_expected(&rows, h.expect.as_deref())
        } else {
            line_answered(addr, h.send.as_deref(), h.expect.as_deref()).await
        }
    };
    matches!(tokio::time::timeout(timeout, check).await, Ok(Some(())))
}

/// A query's answer passes when its first row's first cell starts with `expect` (any answer
/// passes without one; a missing cell counts as empty).
fn first_cell_expected(rows: &[Vec<Option<String>>], expect: Option<&str>) -> Option<()> {
    if let Some(e) = expect {
        let first = rows.first().and_then(|r| r.first().cloned().flatten()).unwrap_or_default();
        if !first.starts_with(e) {
            return None;
        }
    }
    Some(())
}

/// The plain TCP probe: the connection is accepted, and when `send` is set, the line sent is
/// answered by a line that starts with `expect`.
async fn line_answered(addr: SocketAddr, send: Option<&str>, expect: Option<&str>) -> Option<()> {
    let mut s = TcpStream::connect(addr).await.ok()?;
    if let Some(send) = send {
        s.write_all(format!("{send}\n").as_bytes()).await.ok()?;
        let mut line = String::new();
        let mut r = BufReader::new(s);
        let n = r.read_line(&mut line).await.ok()?;
        if n == 0 {
            return None;
        }
        if let Some(e) = expect {
            if !line.starts_with(e) {
                return None;
            }
        }
    }
    Some(())
}
