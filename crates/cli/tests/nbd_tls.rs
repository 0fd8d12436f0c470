//! `understudy volume nbd` with TLS, against a real cluster: qemu-io writes and reads a volume
//! over TLS with a client certificate; plain NBD and a client without a certificate are
//! refused and change nothing; plain NBD on an address other than loopback is refused at start
//! unless --insecure, and bad TLS options get one clear line.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};

use common::*;

/// qemu-io over TLS with the gnutls credentials in `creds` (None: plain NBD) on `vol` at
/// `addr`: (every command succeeded, output).
fn qemu_io_tls(addr: &str, creds: Option<&Path>, commands: &[&str]) -> (bool, String) {
    let (host, port) = addr.rsplit_once(':').unwrap();
    let mut opts = format!("driver=nbd,server.type=inet,server.host={host},server.port={port},export=vol");
    let mut cmd = Command::new("qemu-io");
    if let Some(dir) = creds {
        cmd.args(["--object", &format!("tls-creds-x509,id=tls0,dir={},endpoint=client", dir.display())]);
        opts.push_str(",tls-creds=tls0");
    }
    cmd.args(["--image-opts", &opts]);
    for c in commands {
        cmd.args(["-c", c]);
    }
    let o = cmd.stdin(Stdio::null()).output().expect("qemu-io");
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    (o.status.success() && !text.contains("failed"), text)
}

#[test]
fn volume_nbd_over_tls_with_client_certificates() {
    require_qemu();
    let mut up = Up::start(3);
    up.ok(&["volume", "create", "vol", "--size", "8M"]);
    let pki = wire::tls::TestPki::write(&up.dir.path().join("pki"));
    let addr = format!("127.0.0.1:{}", wire::ports::free_loopback_port().unwrap());
    let (meta, secret) = (up.meta_addr(), up.secret_file());
    let log = up.dir.path().join("nbd-tls.log");
    let s = |p: std::path::PathBuf| p.to_string_lossy().into_owned();
    let args = [
        "volume", "nbd", "--meta", &meta, "--secret-file", &s(secret), "--listen", &addr,
        "--tls-cert", &s(pki.path("server-cert.pem")), "--tls-key", &s(pki.path("server-key.pem")),
        "--tls-ca", &s(pki.path("ca-cert.pem")),
    ];
    up.spawn(&args, &log);
    let with_cert = pki.path("with-cert");
    // qemu-io does not retry a refused connection: wait until the server listens (a started
    // process binds only when it runs, which on a loaded machine can be a while).
    let t = std::time::Instant::now();
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(t.elapsed() < std::time::Duration::from_secs(30), "the NBD server did not listen on {addr} within 30 s:\n{}", std::fs::read_to_string(&log).unwrap_or_default());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (ok, out) = qemu_io_tls(&addr, Some(&with_cert), &["write -P 0xab 64k 128k", "flush"]);
    assert!(ok, "qemu-io over TLS: {out}\n--- server log:\n{}", std::fs::read_to_string(&log).unwrap_or_default());

    let (ok, out) = qemu_io_tls(&addr, None, &["write -P 0xcd 0 64k"]);
    assert!(!ok && out.contains("TLS"), "plain NBD to a server that requires TLS: {out}");
    let (ok, out) = qemu_io_tls(&addr, Some(&pki.path("ca-only")), &["write -P 0xcd 0 64k"]);
    assert!(!ok, "a client without a certificate wrote: {out}");

    // The bytes are on the volume (read back over TLS, and through the cluster's own plain
    // loopback NBD server), and the refused clients changed nothing.
    let (ok, out) = qemu_io_tls(&addr, Some(&with_cert), &["read -P 0xab 64k 128k", "read -P 0 0 64k"]);
    assert!(ok, "read-back over TLS: {out}");
    qemu_ok(&up.uri("vol"), &["read -P 0xab 64k 128k", "read -P 0 0 64k"]);
}

#[test]
fn volume_nbd_refuses_plain_nbd_off_loopback_and_bad_tls_options() {
    let dir = tempfile::tempdir().unwrap();
    let base = ["volume", "nbd", "--meta", "127.0.0.1:1", "--secret-file", "/nonexistent-secret"];
    let run = |extra: &[&str]| Command::new(BIN).args(base).args(extra).stdin(Stdio::null()).output().unwrap();
    let missing = dir.path().join("missing.pem").to_string_lossy().into_owned();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--listen", "0.0.0.0:0"], "not a loopback address"),
        (vec!["--listen", "0.0.0.0:0"], "--insecure"),
        (vec!["--tls", "require"], "--tls-cert FILE and --tls-key FILE"),
        (vec!["--tls", "off", "--tls-ca", "ca.pem"], "--tls=off"),
        (vec!["--tls-cert", &missing, "--tls-key", &missing], "missing.pem"),
    ];
    for (extra, expect) in &cases {
        let o = run(extra);
        let err = expect_one_line_error(&o, &format!("volume nbd {}", extra.join(" ")));
        assert!(err.contains(expect), "`volume nbd {}`: expected {expect:?} in {err:?}", extra.join(" "));
    }
    // With --insecure the same address passes the check and fails only later, on the secret.
    let o = run(&["--listen", "0.0.0.0:0", "--insecure"]);
    let err = expect_one_line_error(&o, "volume nbd --insecure");
    assert!(err.contains("nonexistent-secret"), "{err}");
}
