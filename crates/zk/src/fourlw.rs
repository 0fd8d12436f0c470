//! Four-letter words: a command of four letters on the client port, the answer as text until
//! the server closes. The servers must allow them (`4lw.commands.whitelist`).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::ZkError;

/// Longest answer read (a `mntr` answer is a few KiB).
const ANSWER_MAX_BYTES: u64 = 64 * 1024;

/// What `srvr` says about a server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerState {
    /// Serving clients: its role and the last zxid it applied.
    Serving { mode: String, zxid: i64 },
    /// Up but not serving (starting, electing a leader, or synchronising with the leader).
    NotServing,
}

/// Sends a four-letter word and returns the answer.
pub async fn four_letter(
    addr: SocketAddr,
    word: &str,
    timeout: Duration,
) -> Result<String, ZkError> {
    if word.len() != 4 || !word.bytes().all(|b| b.is_ascii_lowercase()) {
        return Err(ZkError::BadArgument(format!(
            "{word:?} is not a four-letter word"
        )));
    }
    let ask = async {
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(word.as_bytes()).await?;
        let mut out = Vec::new();
        (&mut s)
            .take(ANSWER_MAX_BYTES)
            .read_to_end(&mut out)
            .await?;
        Ok::<_, ZkError>(String::from_utf8_lossy(&out).into_owned())
    };
    tokio::time::timeout(timeout, ask)
        .await
        .map_err(|_| ZkError::Timeout(timeout))?
}

/// `srvr` on `addr`, parsed.
pub async fn srvr(addr: SocketAddr, timeout: Duration) -> Result<ServerState, ZkError> {
    parse_srvr(&four_letter(addr, "srvr", timeout).await?)
}

/// Parses a `srvr` answer: `Zxid: 0x...` and `Mode: ...` lines, or the notice of a server that
/// is not serving.
pub fn parse_srvr(text: &str) -> Result<ServerState, ZkError> {
    if text.contains("not currently serving") {
        return Ok(ServerState::NotServing);
    }
    if text.contains("is not executed because it is not in the whitelist") {
        return Err(ZkError::Setup(
            "srvr is not allowed: add it to 4lw.commands.whitelist".into(),
        ));
    }
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
    };
    let zxid = field("Zxid:")
        .ok_or_else(|| ZkError::Protocol(format!("no Zxid in srvr answer {text:?}")))?;
    let zxid = i64::from_str_radix(zxid.trim_start_matches("0x"), 16)
        .map_err(|_| ZkError::Protocol(format!("bad Zxid {zxid:?}")))?;
    let mode = field("Mode:")
        .ok_or_else(|| ZkError::Protocol(format!("no Mode in srvr answer {text:?}")))?;
    Ok(ServerState::Serving {
        mode: mode.to_string(),
        zxid,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_srvr() {
        let text = "Zookeeper version: 3.8.0\nLatency min/avg/max: 0/0.0/0\nReceived: 1\nSent: 0\n\
                    Connections: 1\nOutstanding: 0\nZxid: 0x10000001a\nMode: follower\nNode count: 5\n";
        assert_eq!(
            parse_srvr(text).unwrap(),
            ServerState::Serving {
                mode: "follower".into(),
                zxid: 0x1_0000_001a
            }
        );
        assert_eq!(
            parse_srvr("This ZooKeeper instance is not currently serving requests\n").unwrap(),
            ServerState::NotServing
        );
        assert!(parse_srvr("garbage").is_err());
        assert!(parse_srvr("Zxid: 0xzz\nMode: leader\n").is_err());
        assert!(parse_srvr("srvr is not executed because it is not in the whitelist.\n").is_err());
    }
}
