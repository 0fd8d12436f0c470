//! A kv group whose links (client to node, node to node, CM to node) run over mutual TLS:
//! `UNDERSTUDY_LINK_TLS=always` with a certificate from the test's CA in every process. Writes
//! read back through the group; a client without the setting gets nothing from the nodes (so
//! the links really are TLS). One test in this file: it sets the environment its processes
//! inherit.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use wire::link::{LINK_TLS_CA_ENV, LINK_TLS_CERT_ENV, LINK_TLS_ENV, LINK_TLS_KEY_ENV};

const BIN: &str = env!("CARGO_BIN_EXE_understudy");

/// `kv up`, stopped by pid (SIGTERM, then SIGKILL) on drop.
struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        testbed::proc::signal(self.0.id(), libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(self.0.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn kv(args: &[&str], cluster: &Path, plain: bool) -> Output {
    let mut c = Command::new(BIN);
    c.arg("kv").args(args).arg("--cluster").arg(cluster).stdin(Stdio::null());
    if plain {
        for v in [LINK_TLS_ENV, LINK_TLS_CERT_ENV, LINK_TLS_KEY_ENV, LINK_TLS_CA_ENV] {
            c.env_remove(v);
        }
    }
    c.output().unwrap()
}

#[test]
fn kv_links_over_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let pki = wire::tls::TestPki::write(&dir.path().join("pki"));
    std::env::set_var(LINK_TLS_ENV, "always");
    std::env::set_var(LINK_TLS_CERT_ENV, pki.path("server-cert.pem"));
    std::env::set_var(LINK_TLS_KEY_ENV, pki.path("server-key.pem"));
    std::env::set_var(LINK_TLS_CA_ENV, pki.path("ca-cert.pem"));
    let data = dir.path().join("kv");
    let log = std::fs::File::create(dir.path().join("up.log")).unwrap();
    let _up = Up(Command::new(BIN)
        .args(["kv", "up", "--dir"])
        .arg(&data)
        .args(["--nodes", "3", "--port-base", "0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap());
    let cluster = data.join("kv-cluster.json");
    // The group serves once the CM granted leases over its TLS links: retry the first put.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let o = kv(&["put", "k1", "v1"], &cluster, false);
        if o.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "kv put over TLS never succeeded: {}\n--- kv up log:\n{}",
            String::from_utf8_lossy(&o.stderr),
            std::fs::read_to_string(dir.path().join("up.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    for i in 2..=20 {
        let o = kv(&["put", &format!("k{i}"), &format!("v{i}")], &cluster, false);
        assert!(o.status.success(), "put k{i}: {}", String::from_utf8_lossy(&o.stderr));
    }
    for i in 1..=20 {
        let o = kv(&["get", &format!("k{i}")], &cluster, false);
        assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), format!("v{i}"), "get k{i}: {}", String::from_utf8_lossy(&o.stderr));
    }
    let t0 = Instant::now();
    let o = kv(&["get", "k1"], &cluster, true);
    assert!(!o.status.success(), "a plain client read from a TLS group: {}", String::from_utf8_lossy(&o.stdout));
    assert!(t0.elapsed() < Duration::from_secs(60), "the refused client hung for {:?}", t0.elapsed());
}
