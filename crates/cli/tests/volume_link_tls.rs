//! A volume cluster whose links (clients and NBD server to the metadata service and shards,
//! shards to the metadata service, replication between shards) all run over mutual TLS:
//! `UNDERSTUDY_LINK_TLS=always` with a certificate from the test's CA in every process. I/O
//! through the NBD server reads back; a client without the TLS setting is refused by the
//! metadata service (so the links really are TLS); a bad setting stops a daemon with its
//! reason. One test in this file: it sets the environment its processes inherit.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use wire::link::{LINK_TLS_CA_ENV, LINK_TLS_CERT_ENV, LINK_TLS_ENV, LINK_TLS_KEY_ENV};

#[test]
fn volume_links_over_mutual_tls() {
    require_qemu();
    let pki_dir = tempfile::tempdir().unwrap();
    let pki = wire::tls::TestPki::write(pki_dir.path());
    // Every process this test starts (up, its daemons, the CLI) inherits these.
    std::env::set_var(LINK_TLS_ENV, "always");
    std::env::set_var(LINK_TLS_CERT_ENV, pki.path("server-cert.pem"));
    std::env::set_var(LINK_TLS_KEY_ENV, pki.path("server-key.pem"));
    std::env::set_var(LINK_TLS_CA_ENV, pki.path("ca-cert.pem"));

    let up = Up::start(3);
    up.ok(&["volume", "create", "vol", "--size", "8M"]);
    qemu_ok(&up.uri("vol"), &["write -P 0x5a 0 1M", "flush"]);
    qemu_ok(&up.uri("vol"), &["read -P 0x5a 0 1M", "read -P 0 1M 1M"]);
    // Super and collapse go through the metadata service and the shards as well.
    up.ok(&["volume", "super", "vol", "--child", "child"]);
    qemu_ok(&up.uri("child"), &["write -P 0x6b 0 64k", "read -P 0x6b 0 64k", "read -P 0x5a 64k 64k"]);

    // A client without the TLS setting does not get through to the metadata service: it
    // waits for the secret's hello, which the service sends only over TLS.
    let t0 = Instant::now();
    let o = Command::new(BIN)
        .args(["volume", "list", "--cluster"])
        .arg(up.cluster_file())
        .env_remove(LINK_TLS_ENV)
        .env_remove(LINK_TLS_CERT_ENV)
        .env_remove(LINK_TLS_KEY_ENV)
        .env_remove(LINK_TLS_CA_ENV)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!o.status.success(), "a plain client listed volumes of a TLS cluster: {}", String::from_utf8_lossy(&o.stdout));
    assert!(t0.elapsed() < Duration::from_secs(60), "the refused client hung for {:?}", t0.elapsed());
    // And a client of another CA is refused.
    let other_dir = tempfile::tempdir().unwrap();
    let other = wire::tls::TestPki::write(other_dir.path());
    let o = Command::new(BIN)
        .args(["volume", "list", "--cluster"])
        .arg(up.cluster_file())
        .env(LINK_TLS_CERT_ENV, other.path("server-cert.pem"))
        .env(LINK_TLS_KEY_ENV, other.path("server-key.pem"))
        .env(LINK_TLS_CA_ENV, other.path("ca-cert.pem"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!o.status.success(), "a client of another CA listed volumes: {}", String::from_utf8_lossy(&o.stdout));
    // With the setting, the same command works.
    assert!(up.ok(&["volume", "list"]).contains("child"));

    // A daemon with a bad setting stops at once with its reason.
    let o = Command::new(BIN)
        .args(["volume", "meta", "--dir"])
        .arg(pki_dir.path().join("meta"))
        .args(["--listen", "127.0.0.1:0", "--secret-file"])
        .arg(up.secret_file())
        .env(LINK_TLS_ENV, "sometimes")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("sometimes"), "meta with UNDERSTUDY_LINK_TLS=sometimes: {err}");
}
