//! Real NBD clients against an in-process server on a MemDev: qemu-io, qemu-img, nbdcopy,
//! nbdinfo and fio's nbd engine. Each tool runs as a child process with a timeout; a missing
//! tool fails the test with the package to install.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use blockdev::{BlockDev, MemDev};
use common::*;
use nbd::{MapExports, SingleExport};

const MIB: u64 = 1 << 20;
const TOOL_TIMEOUT: Duration = Duration::from_secs(120);

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nbd-clients-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn qemu_io(uri: &str, commands: &[&str]) -> ToolOutput {
    require_tool("qemu-io", "qemu-utils");
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw", uri]);
    for c in commands {
        cmd.args(["-c", c]);
    }
    run_with_timeout(&mut cmd, TOOL_TIMEOUT)
}

fn assert_qemu_io_clean(out: &ToolOutput) {
    let text = out.all();
    assert!(out.success(), "qemu-io failed:\n{text}");
    for bad in ["failed", "Pattern verification", "error", "Error"] {
        assert!(!text.contains(bad), "qemu-io reported {bad:?}:\n{text}");
    }
}

#[test]
fn qemu_io_writes_and_reads_a_pattern() {
    let dev = Arc::new(MemDev::new(64 * MIB));
    let server = TestServer::start(SingleExport::new("name", dev.clone()));
    let out = qemu_io(
        &server.uri("name"),
        &[
            "write -P 0xab 0 64k",
            "read -P 0xab 0 64k",
            "read -P 0 64k 64k",
        ],
    );
    assert_qemu_io_clean(&out);
    assert!(
        out.stdout.contains("wrote 65536/65536 bytes"),
        "{}",
        out.all()
    );
    assert!(
        out.stdout.contains("read 65536/65536 bytes"),
        "{}",
        out.all()
    );
    let data = server.runtime.block_on(dev.read(0, 65536)).unwrap();
    assert!(data.iter().all(|&b| b == 0xab));
}

#[test]
fn qemu_io_flush_discard_and_write_zeroes() {
    let dev = Arc::new(MemDev::new(64 * MIB));
    let server = TestServer::start(SingleExport::new("name", dev.clone()));
    let out = qemu_io(
        &server.uri("name"),
        &[
            "write -P 0xcd 0 1M",
            "flush",
            "discard 0 64k",
            "read -P 0 0 64k",
            "write -z 64k 64k",
            "read -P 0 64k 64k",
            "read -P 0xcd 128k 64k",
            "write -z -u 256k 64k",
            "read -P 0 256k 64k",
            "write -f -P 0x11 512k 4k",
            "flush",
        ],
    );
    assert_qemu_io_clean(&out);
    let data = server.runtime.block_on(dev.read(0, MIB as u32)).unwrap();
    assert!(data[..128 << 10].iter().all(|&b| b == 0));
    assert!(data[128 << 10..256 << 10].iter().all(|&b| b == 0xcd));
    assert!(data[256 << 10..320 << 10].iter().all(|&b| b == 0));
    assert!(data[512 << 10..(512 << 10) + 4096]
        .iter()
        .all(|&b| b == 0x11));
}

#[test]
fn qemu_io_sees_a_refused_write_as_an_io_error() {
    let dev = Arc::new(FaultyDev::new(16 * MIB));
    let server = TestServer::start(SingleExport::new("name", dev.clone()));
    let uri = server.uri("name");
    // Before fencing, writes work.
    assert_qemu_io_clean(&qemu_io(&uri, &["write -P 0x5a 0 4k"]));
    dev.refuse_all_writes.store(true, Ordering::SeqCst);
    let out = qemu_io(&uri, &["write -P 0x77 0 4k", "read -P 0x5a 0 4k"]);
    let text = out.all();
    assert!(
        text.contains("write failed: Operation not permitted"),
        "refused write not reported as EPERM:\n{text}"
    );
    // Reads still work and the old data is intact.
    assert!(text.contains("read 4096/4096 bytes"), "{text}");
    assert!(!text.contains("Pattern verification failed"), "{text}");
}

#[test]
fn qemu_img_info_reports_the_size() {
    require_tool("qemu-img", "qemu-utils");
    let dev = Arc::new(MemDev::new(48 * MIB));
    let server = TestServer::start(SingleExport::new("name", dev));
    let out = run_with_timeout(
        Command::new("qemu-img").args(["info", "--output=json", "-f", "raw", &server.uri("name")]),
        TOOL_TIMEOUT,
    );
    assert!(out.success(), "qemu-img info failed:\n{}", out.all());
    assert!(
        out.stdout
            .contains(&format!("\"virtual-size\": {}", 48 * MIB)),
        "{}",
        out.all()
    );
}

#[test]
fn nbdinfo_lists_exports() {
    require_tool("nbdinfo", "libnbd-bin");
    let dev = Arc::new(MemDev::new(MIB));
    let server = TestServer::start(
        MapExports::new()
            .with("alpha", dev.clone())
            .with("beta", dev),
    );
    let uri = format!("nbd://127.0.0.1:{}", server.addr.port());
    let out = run_with_timeout(Command::new("nbdinfo").args(["--list", &uri]), TOOL_TIMEOUT);
    assert!(out.success(), "nbdinfo --list failed:\n{}", out.all());
    assert!(
        out.stdout.contains("alpha") && out.stdout.contains("beta"),
        "{}",
        out.all()
    );
}

#[test]
fn nbdcopy_copies_a_file_in_and_out() {
    require_tool("nbdcopy", "libnbd-bin");
    let size_bytes = 24 * MIB;
    let dev = Arc::new(MemDev::new(size_bytes));
    let server = TestServer::start(SingleExport::new("name", dev.clone()));
    let dir = temp_dir("nbdcopy");
    let input = dir.join("in.img");
    let output = dir.join("out.img");
    // Deterministic pseudo-random contents, with a zero hole in the middle.
    let mut contents = vec![0u8; size_bytes as usize];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for (i, chunk) in contents.chunks_mut(8).enumerate() {
        if (8 * MIB as usize..10 * MIB as usize).contains(&(i * 8)) {
            continue;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    std::fs::write(&input, &contents).unwrap();

    let uri = server.uri("name");
    let out = run_with_timeout(Command::new("nbdcopy").arg(&input).arg(&uri), TOOL_TIMEOUT);
    assert!(out.success(), "nbdcopy in failed:\n{}", out.all());
    let on_dev = server
        .runtime
        .block_on(dev.read(0, size_bytes as u32))
        .unwrap();
    assert!(
        on_dev == contents,
        "device contents differ from the copied file"
    );

    let out = run_with_timeout(Command::new("nbdcopy").arg(&uri).arg(&output), TOOL_TIMEOUT);
    assert!(out.success(), "nbdcopy out failed:\n{}", out.all());
    let copied = std::fs::read(&output).unwrap();
    assert!(
        copied == contents,
        "file copied out differs from the file copied in"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fio_randwrite_with_verify_at_iodepth_16() {
    require_tool("fio", "fio");
    let dev = Arc::new(MemDev::new(64 * MIB));
    let server = TestServer::start(SingleExport::new("name", dev));
    let out = run_with_timeout(
        Command::new("fio").args([
            "--name=nbd-verify",
            "--ioengine=nbd",
            &format!("--uri={}", server.uri("name")),
            "--rw=randwrite",
            "--bsrange=4k-64k",
            "--iodepth=16",
            "--size=32m",
            // A few seconds of writes, each verified by reading it back while the job runs
            // (verify_backlog), then a final verify pass over what is left.
            "--time_based",
            "--runtime=3",
            "--verify=crc32c",
            "--verify_backlog=256",
            "--do_verify=1",
            "--verify_fatal=1",
            "--thread",
            "--verify_state_save=0",
            "--output-format=normal",
        ]),
        TOOL_TIMEOUT,
    );
    let text = out.all();
    assert!(out.success(), "fio failed:\n{text}");
    assert!(
        !text.contains("verify: bad"),
        "fio reported a verify failure:\n{text}"
    );
    assert!(text.contains("err= 0"), "fio job reported errors:\n{text}");
    // Verification read the data back.
    assert!(
        text.contains("READ:"),
        "fio did not verify (no reads):\n{text}"
    );
    assert!(text.contains("iodepth=16"), "{text}");
}

#[test]
fn qemu_io_over_a_unix_socket() {
    let dir = temp_dir("unix");
    let socket = dir.join("nbd.sock");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dev = Arc::new(MemDev::new(8 * MIB));
    let listener = rt
        .block_on(async { tokio::net::UnixListener::bind(&socket) })
        .unwrap();
    rt.spawn(nbd::serve_unix(
        listener,
        SingleExport::new("name", dev.clone()),
    ));
    let uri = format!("nbd+unix:///name?socket={}", socket.display());
    assert_qemu_io_clean(&qemu_io(
        &uri,
        &["write -P 0x42 1M 128k", "read -P 0x42 1M 128k"],
    ));
    assert_eq!(rt.block_on(dev.read(MIB, 4)).unwrap(), vec![0x42; 4]);
    drop(rt);
    let _ = std::fs::remove_dir_all(&dir);
}
