//! Mutual challenge-response authentication over a cluster secret.
//!
//! The server sends a magic, a protocol version and a fresh 32-byte nonce; the client answers with
//! its own nonce and `HMAC-SHA256(secret, "client" | server_nonce | client_nonce)`; the server checks
//! it and proves itself with `HMAC-SHA256(secret, "server" | client_nonce | server_nonce)`. Neither
//! side reveals the secret, and a replayed answer fails against a new nonce.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::WireError;

const MAGIC: &[u8; 8] = b"UNDRSTDY";
const VERSION: u32 = 1;
const NONCE_BYTES: usize = 32;
const MAC_BYTES: usize = 32;

fn mac(secret: &[u8], role: &[u8], a: &[u8], b: &[u8]) -> [u8; MAC_BYTES] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(role);
    m.update(a);
    m.update(b);
    m.finalize().into_bytes().into()
}

fn equal_ct(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Server side of the handshake: returns once the client proved it knows `secret`. Fails if
/// the client has not within [`crate::listen::AUTH_DEADLINE`]: a connection that never
/// authenticates must not hold a server's descriptor and connection slot for long.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, secret: &[u8]) -> Result<(), WireError> {
    let deadline = crate::listen::AUTH_DEADLINE;
    tokio::time::timeout(deadline, accept_inner(s, secret))
        .await
        .map_err(|_| WireError::Auth(format!("no authentication within {deadline:?}")))?
}

async fn accept_inner<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, secret: &[u8]) -> Result<(), WireError> {
    let server_nonce: [u8; NONCE_BYTES] = rand::random();
    let mut hello = Vec::with_capacity(8 + 4 + NONCE_BYTES);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&VERSION.to_le_bytes());
    hello.extend_from_slice(&server_nonce);
    s.write_all(&hello).await?;
    s.flush().await?;
    let mut answer = [0u8; NONCE_BYTES + MAC_BYTES];
    s.read_exact(&mut answer).await.map_err(|_| WireError::Auth("peer closed during handshake".into()))?;
    let (client_nonce, client_mac) = answer.split_at(NONCE_BYTES);
    if !equal_ct(client_mac, &mac(secret, b"client", &server_nonce, client_nonce)) {
        return Err(WireError::Auth("client does not know the cluster secret".into()));
    }
    s.write_all(&mac(secret, b"server", client_nonce, &server_nonce)).await?;
    s.flush().await?;
    Ok(())
}

/// Bytes of the server's hello: magic, version, nonce.
pub const HELLO_BYTES: usize = 8 + 4 + NONCE_BYTES;
/// Bytes of the client's answer: its nonce and its proof.
pub const ANSWER_BYTES: usize = NONCE_BYTES + MAC_BYTES;
/// Bytes of the server's proof.
pub const PROOF_BYTES: usize = MAC_BYTES;

/// The client's half of the handshake without I/O (shared by the async [`connect`] and blocking
/// clients such as the LD_PRELOAD shim's): checks the server's hello and returns the answer to
/// send and the proof the server must send back.
pub fn client_answer(hello: &[u8; HELLO_BYTES], secret: &[u8]) -> Result<([u8; ANSWER_BYTES], [u8; PROOF_BYTES]), WireError> {
    if &hello[..8] != MAGIC {
        return Err(WireError::Auth("peer is not an Understudy server".into()));
    }
    let version = u32::from_le_bytes(hello[8..12].try_into().unwrap());
    if version != VERSION {
        return Err(WireError::Auth(format!("peer speaks protocol version {version}, we speak {VERSION}")));
    }
    let server_nonce = &hello[12..];
    let client_nonce: [u8; NONCE_BYTES] = rand::random();
    let mut answer = [0u8; ANSWER_BYTES];
    answer[..NONCE_BYTES].copy_from_slice(&client_nonce);
    answer[NONCE_BYTES..].copy_from_slice(&mac(secret, b"client", server_nonce, &client_nonce));
    Ok((answer, mac(secret, b"server", &client_nonce, server_nonce)))
}

/// Checks the server's proof against the one [`client_answer`] expects.
pub fn check_server_proof(got: &[u8; PROOF_BYTES], want: &[u8; PROOF_BYTES]) -> Result<(), WireError> {
    if equal_ct(got, want) {
        Ok(())
    } else {
        Err(WireError::Auth("server does not know the cluster secret".into()))
    }
}

/// Client side of the handshake: returns once the server proved it knows `secret`.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, secret: &[u8]) -> Result<(), WireError> {
    let mut hello = [0u8; HELLO_BYTES];
    s.read_exact(&mut hello).await.map_err(|_| WireError::Auth("peer closed during handshake".into()))?;
    let (answer, want) = client_answer(&hello, secret)?;
    s.write_all(&answer).await?;
    s.flush().await?;
    let mut server_mac = [0u8; PROOF_BYTES];
    s.read_exact(&mut server_mac)
        .await
        .map_err(|_| WireError::Auth("server refused our cluster secret".into()))?;
    check_server_proof(&server_mac, &want)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn same_secret_passes() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let (r1, r2) = tokio::join!(accept(&mut a, b"s3cret"), connect(&mut b, b"s3cret"));
        r1.unwrap();
        r2.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_never_answers_is_dropped_at_the_deadline() {
        let (mut a, _silent) = tokio::io::duplex(1024);
        let t0 = tokio::time::Instant::now();
        let r = accept(&mut a, b"s3cret").await;
        assert!(matches!(r, Err(WireError::Auth(_))), "{r:?}");
        assert_eq!(t0.elapsed(), crate::listen::AUTH_DEADLINE);
    }

    #[tokio::test]
    async fn wrong_secret_fails_both_ways() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let server = tokio::spawn(async move { accept(&mut a, b"right").await });
        let client = connect(&mut b, b"wrong").await;
        assert!(server.await.unwrap().is_err());
        assert!(client.is_err());
    }
}
