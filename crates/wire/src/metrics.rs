//! A minimal HTTP endpoint serving metrics in the Prometheus text format.
//!
//! Every daemon exposes one (`--metrics ADDR`). Only `GET /metrics` is answered; anything else
//! gets a 404, and a request larger than [`MAX_REQUEST_BYTES`] or slower than the timeout is
//! dropped, so the endpoint cannot be used to tie the daemon up.

use std::future::Future;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

pub const MAX_REQUEST_BYTES: usize = 8 * 1024;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves `render()` at `/metrics` until the task is dropped.
pub async fn serve<F, Fut>(listener: TcpListener, render: F)
where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = String> + Send,
{
    crate::listen::serve(listener, "metrics endpoint", move |mut sock, _| {
        let render = render.clone();
        async move {
            let mut buf = vec![0u8; MAX_REQUEST_BYTES];
            let mut n = 0;
            let read = async {
                while n < buf.len() {
                    let got = sock.read(&mut buf[n..]).await?;
                    if got == 0 {
                        break;
                    }
                    n += got;
                    if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                Ok::<_, std::io::Error>(())
            };
            if tokio::time::timeout(REQUEST_TIMEOUT, read).await.is_err() {
                return;
            }
            let head = String::from_utf8_lossy(&buf[..n]);
            let (status, body) = if head.starts_with("GET /metrics ") || head.starts_with("GET /metrics?") {
                ("200 OK", render().await)
            } else {
                ("404 Not Found", "only /metrics is served here\n".to_string())
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
        }
    })
    .await
}

/// Appends one metric (with its HELP and TYPE lines) to a Prometheus text body.
pub fn metric(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(&str, f64)]) {
    use std::fmt::Write;
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, v) in samples {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {v}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn serves_metrics_and_refuses_other_paths() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(serve(l, || async {
            let mut s = String::new();
            metric(&mut s, "understudy_test_total", "counter", "A test counter.", &[("", 3.0)]);
            s
        }));
        let get = |path: &'static str| async move {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            c.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).await.unwrap();
            let mut r = String::new();
            c.read_to_string(&mut r).await.unwrap();
            r
        };
        let ok = get("/metrics").await;
        assert!(ok.starts_with("HTTP/1.1 200") && ok.contains("understudy_test_total 3"), "{ok}");
        assert!(get("/other").await.starts_with("HTTP/1.1 404"));
    }
}
