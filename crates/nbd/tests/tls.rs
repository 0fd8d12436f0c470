//! NBD over TLS (NBD_OPT_STARTTLS) with real clients: qemu-io and qemu-img (gnutls, through
//! `--object tls-creds-x509`), nbdcopy and nbdinfo (libnbd, `nbds://` URIs). A CA, a server
//! certificate and a client certificate are made by the test (rcgen) in its own directory.
//! Checked: data written over TLS reads back, byte for byte, on the device; a client without
//! a certificate is refused when the server asks for one; a plain client is refused by a
//! server that requires TLS; the spec's rules before the upgrade (NBD_REP_ERR_TLS_REQD).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use blockdev::{BlockDev, MemDev};
use common::*;
use nbd::proto::*;
use nbd::{Server, SingleExport};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const MIB: u64 = 1 << 20;
const TOOL_TIMEOUT: Duration = Duration::from_secs(120);

/// A test directory, removed on drop.
struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A [`wire::tls::TestPki`] in its own directory, removed on drop.
struct Pki {
    pki: wire::tls::TestPki,
    _dir: Dir,
}

impl Pki {
    fn new(tag: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("nbd-tls-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Pki { pki: wire::tls::TestPki::write(&dir), _dir: Dir(dir) }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.pki.path(name)
    }

    /// A server that requires TLS, and client certificates when `client_certs`.
    fn server(&self, dev: Arc<MemDev>, client_certs: bool) -> TestServer {
        let acceptor = wire::tls::acceptor(&self.pki.server_files(client_certs)).unwrap();
        TestServer::start_server(Server::new(SingleExport::new("vol", dev)).with_tls(acceptor))
    }
}

/// qemu-io on `export` of the server at `port`, over TLS with the credentials in `creds`
/// (None: plain NBD).
fn qemu_io_tls(port: u16, creds: Option<&Path>, commands: &[&str]) -> ToolOutput {
    require_tool("qemu-io", "qemu-utils");
    let mut cmd = Command::new("qemu-io");
    let mut opts = format!("driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={port},export=vol");
    if let Some(dir) = creds {
        cmd.args(["--object", &format!("tls-creds-x509,id=tls0,dir={},endpoint=client", dir.display())]);
        opts.push_str(",tls-creds=tls0");
    }
    cmd.args(["--image-opts", &opts]);
    for c in commands {
        cmd.args(["-c", c]);
    }
    run_with_timeout(&mut cmd, TOOL_TIMEOUT)
}

fn assert_clean(tool: &str, out: &ToolOutput) {
    let text = out.all();
    assert!(out.success(), "{tool} failed:\n{text}");
    for bad in ["failed", "Pattern verification", "error", "Error"] {
        assert!(!text.contains(bad), "{tool} reported {bad:?}:\n{text}");
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn qemu_io_and_qemu_img_over_tls_with_a_client_certificate() {
    let pki = Pki::new("qemu");
    let dev = Arc::new(MemDev::new(4 * MIB));
    let server = pki.server(dev.clone(), true);
    let port = server.addr.port();
    let creds = pki.path("with-cert");

    let out = qemu_io_tls(port, Some(&creds), &["write -P 0xab 64k 128k", "read -P 0xab 64k 128k", "flush"]);
    assert_clean("qemu-io over TLS", &out);
    let on_dev = server.runtime.block_on(dev.read(0, 256 << 10)).unwrap();
    assert!(on_dev[..64 << 10].iter().all(|&b| b == 0), "bytes before the write changed");
    assert!(on_dev[64 << 10..192 << 10].iter().all(|&b| b == 0xab), "the write over TLS did not reach the device");

    // A fresh connection reads the bytes back, and qemu-img sees the export's size.
    let out = qemu_io_tls(port, Some(&creds), &["read -P 0xab 64k 128k", "read -P 0 0 64k"]);
    assert_clean("qemu-io read-back over TLS", &out);
    require_tool("qemu-img", "qemu-utils");
    let out = run_with_timeout(
        Command::new("qemu-img").args([
            "info",
            "--output=json",
            "--object",
            &format!("tls-creds-x509,id=tls0,dir={},endpoint=client", creds.display()),
            "--image-opts",
            &format!("driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={port},export=vol,tls-creds=tls0"),
        ]),
        TOOL_TIMEOUT,
    );
    assert!(out.success(), "qemu-img info over TLS failed:\n{}", out.all());
    let info: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.all()));
    assert_eq!(info["virtual-size"], 4 * MIB, "{}", out.stdout);
}

#[test]
fn nbdcopy_and_nbdinfo_over_tls() {
    require_tool("nbdcopy", "libnbd-bin");
    require_tool("nbdinfo", "libnbd-bin");
    let pki = Pki::new("libnbd");
    let size_bytes = 8 * MIB;
    let dev = Arc::new(MemDev::new(size_bytes));
    let server = pki.server(dev.clone(), true);
    let uri = format!(
        "nbds://localhost:{}/vol?tls-certificates={}",
        server.addr.port(),
        pki.path("with-cert").display()
    );
    let contents = pattern(size_bytes as usize, 0x5eed);
    let input = pki.path("in.img");
    let output = pki.path("out.img");
    std::fs::write(&input, &contents).unwrap();

    let out = run_with_timeout(Command::new("nbdcopy").arg(&input).arg(&uri), TOOL_TIMEOUT);
    assert!(out.success(), "nbdcopy in over TLS failed:\n{}", out.all());
    let on_dev = server.runtime.block_on(dev.read(0, size_bytes as u32)).unwrap();
    assert!(on_dev == contents, "the device differs from the file copied in over TLS");
    let out = run_with_timeout(Command::new("nbdcopy").arg(&uri).arg(&output), TOOL_TIMEOUT);
    assert!(out.success(), "nbdcopy out over TLS failed:\n{}", out.all());
    assert!(std::fs::read(&output).unwrap() == contents, "the file copied out over TLS differs");

    let out = run_with_timeout(Command::new("nbdinfo").args(["--json", &uri]), TOOL_TIMEOUT);
    assert!(out.success(), "nbdinfo over TLS failed:\n{}", out.all());
    let info: serde_json::Value = serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.all()));
    assert_eq!(info["TLS"], true, "nbdinfo says the connection is not over TLS: {}", out.stdout);
    assert_eq!(info["exports"][0]["export-size"], size_bytes, "{}", out.stdout);
}

/// What a server that requires TLS and client certificates refuses: a client without a
/// certificate (qemu-io and nbdcopy), and plain NBD (qemu-io, nbdinfo). The device is unchanged.
#[test]
fn clients_without_a_certificate_or_without_tls_are_refused() {
    let pki = Pki::new("refused");
    let dev = Arc::new(MemDev::new(MIB));
    let server = pki.server(dev.clone(), true);
    let port = server.addr.port();

    let out = qemu_io_tls(port, Some(&pki.path("ca-only")), &["write -P 0xcd 0 64k"]);
    assert!(!out.success() || out.all().contains("failed"), "qemu-io without a client certificate wrote:\n{}", out.all());
    let out = qemu_io_tls(port, None, &["write -P 0xcd 0 64k"]);
    assert!(!out.success() || out.all().contains("failed"), "plain qemu-io wrote to a TLS-only server:\n{}", out.all());
    assert!(out.all().contains("TLS"), "qemu-io's error should name TLS:\n{}", out.all());

    require_tool("nbdcopy", "libnbd-bin");
    let input = pki.path("in.img");
    std::fs::write(&input, vec![0xcdu8; MIB as usize]).unwrap();
    let no_cert = format!("nbds://localhost:{port}/vol?tls-certificates={}", pki.path("ca-only").display());
    let out = run_with_timeout(Command::new("nbdcopy").arg(&input).arg(&no_cert), TOOL_TIMEOUT);
    assert!(!out.success(), "nbdcopy without a client certificate succeeded:\n{}", out.all());
    let out = run_with_timeout(Command::new("nbdinfo").arg(format!("nbd://localhost:{port}/vol")), TOOL_TIMEOUT);
    assert!(!out.success(), "plain nbdinfo succeeded against a TLS-only server:\n{}", out.all());

    let on_dev = server.runtime.block_on(dev.read(0, MIB as u32)).unwrap();
    assert!(on_dev.iter().all(|&b| b == 0), "a refused client changed the device");

    // Without a client CA, a client with only the CA connects (the server certificate is
    // what it checks).
    let open = pki.server(dev, false);
    let out = qemu_io_tls(open.addr.port(), Some(&pki.path("ca-only")), &["write -P 0xef 0 4k", "read -P 0xef 0 4k"]);
    assert_clean("qemu-io over TLS without a client certificate", &out);
}

/// The spec's rules before the upgrade, byte by byte: LIST/GO/INFO get NBD_REP_ERR_TLS_REQD,
/// STARTTLS with data is invalid, ABORT is honoured, EXPORT_NAME closes the connection.
#[test]
fn options_before_starttls_are_refused_per_the_spec() {
    let pki = Pki::new("spec");
    let server = pki.server(Arc::new(MemDev::new(MIB)), false);
    server.runtime.block_on(async {
        let mut s = TcpStream::connect(server.addr).await.unwrap();
        greet(&mut s, NBD_FLAG_C_FIXED_NEWSTYLE).await.unwrap();
        for option in [NBD_OPT_LIST, NBD_OPT_GO, NBD_OPT_INFO, NBD_OPT_STRUCTURED_REPLY] {
            let data = if option == NBD_OPT_LIST || option == NBD_OPT_STRUCTURED_REPLY { vec![] } else { encode_info_request(&InfoRequest { name: "vol".into(), info_types: vec![] }) };
            send_option(&mut s, option, &data).await.unwrap();
            let r = read_option_reply(&mut s).await.unwrap();
            assert_eq!((r.option, r.reply_type), (option, NBD_REP_ERR_TLS_REQD), "option {option}");
        }
        send_option(&mut s, NBD_OPT_STARTTLS, &[1, 2]).await.unwrap();
        assert_eq!(read_option_reply(&mut s).await.unwrap().reply_type, NBD_REP_ERR_INVALID);
        send_option(&mut s, NBD_OPT_ABORT, &[]).await.unwrap();
        assert_eq!(read_option_reply(&mut s).await.unwrap().reply_type, NBD_REP_ACK);

        let mut s = TcpStream::connect(server.addr).await.unwrap();
        greet(&mut s, NBD_FLAG_C_FIXED_NEWSTYLE).await.unwrap();
        send_option(&mut s, NBD_OPT_EXPORT_NAME, b"vol").await.unwrap();
        s.flush().await.unwrap();
        assert!(is_closed(&mut s, Duration::from_secs(10)).await, "EXPORT_NAME before STARTTLS left the connection open");

        // STARTTLS is acknowledged; bytes sent before the TLS handshake end the connection.
        let mut s = TcpStream::connect(server.addr).await.unwrap();
        greet(&mut s, NBD_FLAG_C_FIXED_NEWSTYLE).await.unwrap();
        let mut opt = Vec::new();
        for o in [NBD_OPT_STARTTLS, NBD_OPT_LIST] {
            opt.extend_from_slice(b"IHAVEOPT");
            opt.extend_from_slice(&o.to_be_bytes());
            opt.extend_from_slice(&0u32.to_be_bytes());
        }
        s.write_all(&opt).await.unwrap();
        let r = read_option_reply(&mut s).await.unwrap();
        assert_eq!((r.option, r.reply_type), (NBD_OPT_STARTTLS, NBD_REP_ACK));
        assert!(is_closed(&mut s, Duration::from_secs(10)).await, "plain bytes after STARTTLS were kept");
    });
}
