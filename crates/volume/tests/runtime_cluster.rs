//! The runtime drivers end to end, in one process: a metadata service and four shards on
//! loopback with real files, a volume client doing I/O, `super` / `collapse` both ways, and the
//! general clone baseline. (The COW benchmark's workload at a tiny size is in
//! `crates/eval/tests/volume_cow.rs`.)

use std::sync::Arc;
use std::time::Duration;

use blockdev::{BlockDev, DevError};
use volume::driver::client::Cluster;
use volume::driver::meta::{MetaReq, MetaResp};
use volume::types::CollapseOutcome;

const SECRET: &[u8] = b"test-secret";

/// Compares byte vectors, reporting the first difference instead of printing both.
#[track_caller]
fn same(got: &[u8], want: &[u8], what: &str) {
    if got != want {
        let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
        panic!("{what}: lengths {} vs {}, first difference at byte {i}: {:?} vs {:?}", got.len(), want.len(), got.get(i), want.get(i));
    }
}

async fn start_cluster(dir: &std::path::Path) -> Arc<Cluster> {
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_test_writer().try_init();
    volume::testkit::start_in_process(dir, 4, SECRET).await.unwrap()
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("understudy-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs a test body on a runtime of its own in a fresh directory, and removes the directory once
/// the runtime is gone: the in-process metadata service and shards are tasks of that runtime and
/// keep writing there (journal, garbage collection) until it stops, so removing it from inside
/// the body failed with ENOTEMPTY and left 170 MB behind on every run. The directory goes even
/// when the body panics; failing to remove it after a passing body fails the test.
fn in_cluster_dir<F: std::future::Future<Output = ()>>(name: &str, body: impl FnOnce(std::path::PathBuf) -> F) {
    struct Remove(std::path::PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let dir = tempdir(name);
    let guard = Remove(dir.clone());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(body(dir.clone()));
    rt.shutdown_timeout(std::time::Duration::from_secs(10));
    std::fs::remove_dir_all(&dir).expect("remove the test directory once its cluster stopped");
    drop(guard);
}

#[test]
fn volume_io_super_collapse_and_general_clone() {
    in_cluster_dir("runtime", |dir| async move {
        let c = start_cluster(&dir).await;
        let mib = 1 << 20;
        c.meta(MetaReq::Create { name: "db".into(), size_bytes: 8 * mib, object_size_bytes: 65536 }).await.unwrap();
        let db = c.open("db").await.unwrap();
        // Unaligned, multi-object writes and reads.
        let mut data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        db.write(30_000, data.clone()).await.unwrap();
        same(&db.read(30_000, 200_000).await.unwrap(), &data, "read");
        db.write_zeroes(100_000, 5_000).await.unwrap();
        data[70_000..75_000].fill(0);
        assert_eq!(db.read(100_000, 5_000).await.unwrap(), vec![0; 5_000]);
        assert!(matches!(db.read(8 * mib - 10, 20).await, Err(DevError::OutOfRange(_))));

        // super, a child write (copy-on-write), collapse with a silent parent: promoted.
        c.meta(MetaReq::Super { parent: "db".into(), child: "db.s1".into() }).await.unwrap();
        let child = c.open("db.s1").await.unwrap();
        same(&child.read(30_000, 200_000).await.unwrap(), &data, "the child starts as the parent");
        child.write(40_000, vec![9; 100]).await.unwrap();
        same(&db.read(40_000, 100).await.unwrap(), &data[10_000..10_100], "the parent is not changed by the child");
        let r = c.meta(MetaReq::Collapse { child: "db.s1".into() }).await.unwrap();
        assert!(matches!(r, MetaResp::Collapsed { outcome: CollapseOutcome::Promoted, .. }), "{r:?}");
        match db.write(0, vec![1; 512]).await {
            Err(DevError::WriteRefused(_)) => {}
            other => panic!("a write to the promoted-away parent must be refused, got {other:?}"),
        }
        c.wait_for_jobs().await.unwrap();
        let child = c.open("db.s1").await.unwrap();
        assert_eq!(child.read(40_000, 100).await.unwrap(), vec![9; 100]);
        same(&child.read(50_000, 1000).await.unwrap(), &data[20_000..21_000], "read");

        // super again; the parent (now db.s1) writes: collapse rejects and the child is discarded.
        c.meta(MetaReq::Super { parent: "db.s1".into(), child: "db.s2".into() }).await.unwrap();
        let s2 = c.open("db.s2").await.unwrap();
        s2.write(0, vec![4; 4096]).await.unwrap();
        child.write(4096, vec![5; 4096]).await.unwrap();
        let r = c.meta(MetaReq::Collapse { child: "db.s2".into() }).await.unwrap();
        assert!(matches!(r, MetaResp::Collapsed { outcome: CollapseOutcome::Rejected, .. }), "{r:?}");
        assert_eq!(child.read(4096, 4096).await.unwrap(), vec![5; 4096]);
        assert!(c.meta(MetaReq::Info { name: "db.s2".into() }).await.is_err(), "a rejected child is gone");
        // Collapsing again answers the outcome decided earlier; collapse of a volume that never
        // was a child is a clear error.
        let r = c.meta(MetaReq::Collapse { child: "db.s1".into() }).await.unwrap();
        assert!(matches!(r, MetaResp::Collapsed { outcome: CollapseOutcome::Promoted, .. }), "{r:?}");
        c.meta(MetaReq::Create { name: "lone".into(), size_bytes: mib, object_size_bytes: 65536 }).await.unwrap();
        let e = c.meta(MetaReq::Collapse { child: "lone".into() }).await.unwrap_err();
        assert!(e.to_string().contains("not a super child"), "{e}");
        let e = c.meta(MetaReq::Info { name: "nope".into() }).await.unwrap_err();
        assert!(e.to_string().contains("no volume named"), "{e}");

        // The rbd-style general clone reads through to its parent and copies up on write.
        c.meta(MetaReq::CloneGeneral { parent: "db.s1".into(), child: "g".into() }).await.unwrap();
        let g = c.open("g").await.unwrap();
        same(&g.read(50_000, 1000).await.unwrap(), &data[20_000..21_000], "read");
        g.write(50_500, vec![7; 10]).await.unwrap();
        let mut expect = data[20_000..21_000].to_vec();
        expect[500..510].fill(7);
        same(&g.read(50_000, 1000).await.unwrap(), &expect, "read");
        same(&child.read(50_000, 1000).await.unwrap(), &data[20_000..21_000], "the general clone's parent is untouched");
    });
}

/// The abort request: the child is rejected and collected while the parent keeps writing;
/// aborting a non-child or a promoted child is a clear error; a repeated abort finds nothing.
#[test]
fn abort_rejects_the_child_and_the_parent_keeps_writing() {
    in_cluster_dir("abort", |dir| async move {
        let c = start_cluster(&dir).await;
        let mib = 1 << 20;
        c.meta(MetaReq::Create { name: "db".into(), size_bytes: 4 * mib, object_size_bytes: 65536 }).await.unwrap();
        let db = c.open("db").await.unwrap();
        db.write(0, vec![1; 8192]).await.unwrap();
        // A silent parent (collapse would promote): abort discards the child all the same.
        c.meta(MetaReq::Super { parent: "db".into(), child: "db.a1".into() }).await.unwrap();
        let a1 = c.open("db.a1").await.unwrap();
        a1.write(0, vec![2; 4096]).await.unwrap();
        let r = c.meta(MetaReq::Abort { child: "db.a1".into() }).await.unwrap();
        assert!(matches!(&r, MetaResp::Volume(v) if v.name == "db" && v.super_child.is_none()), "{r:?}");
        assert!(c.meta(MetaReq::Info { name: "db.a1".into() }).await.is_err(), "an aborted child is gone");
        // The parent kept permission to write, and holds its own data, not the child's.
        db.write(4096, vec![3; 4096]).await.unwrap();
        assert_eq!(db.read(0, 8192).await.unwrap(), [vec![1; 4096], vec![3; 4096]].concat());
        c.wait_for_jobs().await.unwrap();
        // A repeated abort: the child no longer exists.
        let e = c.meta(MetaReq::Abort { child: "db.a1".into() }).await.unwrap_err();
        assert!(e.to_string().contains("no volume named"), "{e}");
        // Not a child at all.
        let e = c.meta(MetaReq::Abort { child: "db".into() }).await.unwrap_err();
        assert!(e.to_string().contains("not a super child"), "{e}");
        // A parent that wrote since super: abort too (collapse would have rejected anyway).
        c.meta(MetaReq::Super { parent: "db".into(), child: "db.a2".into() }).await.unwrap();
        db.write(0, vec![4; 512]).await.unwrap();
        c.meta(MetaReq::Abort { child: "db.a2".into() }).await.unwrap();
        db.write(512, vec![5; 512]).await.unwrap();
        c.wait_for_jobs().await.unwrap();
        // A promoted child cannot be aborted: while its garbage collection runs, the error says so.
        c.meta(MetaReq::Super { parent: "db".into(), child: "db.p".into() }).await.unwrap();
        let r = c.meta(MetaReq::Collapse { child: "db.p".into() }).await.unwrap();
        assert!(matches!(r, MetaResp::Collapsed { outcome: CollapseOutcome::Promoted, .. }), "{r:?}");
        let e = c.meta(MetaReq::Abort { child: "db.p".into() }).await.unwrap_err();
        assert!(e.to_string().contains("was promoted"), "{e}");
        c.wait_for_jobs().await.unwrap();
        let e = c.meta(MetaReq::Abort { child: "db.p".into() }).await.unwrap_err();
        assert!(e.to_string().contains("was promoted"), "after its garbage collection too: {e}");
        let p = c.open("db.p").await.unwrap();
        assert_eq!(p.read(0, 1024).await.unwrap(), [vec![4; 512], vec![5; 512]].concat(), "the promoted child holds the parent's data");
    });
}

/// A stranger without the cluster secret cannot talk to a shard or the metadata service, a peer
/// speaking nonsense is cut off, and both keep serving everyone else.
#[test]
fn strangers_and_nonsense_are_refused_and_service_goes_on() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    in_cluster_dir("garbage", |dir| async move {
        let c = start_cluster(&dir).await;
        c.meta(MetaReq::Create { name: "v".into(), size_bytes: 1 << 20, object_size_bytes: 65536 }).await.unwrap();
        let v = c.open("v").await.unwrap();
        v.write(0, vec![3; 4096]).await.unwrap();
        let map = c.map();
        let shard_addr = map.shards[0].addr.clone();

        // Wrong secret: the client library reports an authentication failure.
        let meta_addr = c.meta_addr().to_string();
        let e = Cluster::connect(&meta_addr, b"wrong").await.err().expect("a wrong secret must be refused");
        assert!(format!("{e:#}").contains("authenticat") || format!("{e:#}").contains("secret"), "{e:#}");

        // Raw garbage before the handshake, and garbage frames after a valid handshake.
        for round in 0..20u8 {
            let mut s = tokio::net::TcpStream::connect(&shard_addr).await.unwrap();
            if round % 2 == 1 {
                let mut hello = [0u8; 44];
                s.read_exact(&mut hello).await.unwrap();
            }
            let junk: Vec<u8> = (0..(round as usize * 37 + 5)).map(|i| (i as u8).wrapping_mul(round).wrapping_add(7)).collect();
            let _ = s.write_all(&junk).await;
            let mut buf = [0u8; 64];
            // The server closes the connection (or it times out the handshake); it never crashes.
            let _ = tokio::time::timeout(Duration::from_secs(6), s.read(&mut buf)).await;
        }
        let mut authed = tokio::net::TcpStream::connect(&shard_addr).await.unwrap();
        wire::auth::connect(&mut authed, SECRET).await.unwrap();
        wire::write_msg(&mut authed, &volume::types::Hello::Client).await.unwrap();
        authed.write_all(&[0xff, 0xff, 0xff, 0x7f, 1, 2, 3, 4]).await.unwrap(); // a 2 GiB frame
        let mut buf = [0u8; 8];
        let n = tokio::time::timeout(Duration::from_secs(5), authed.read(&mut buf)).await.unwrap().unwrap_or(0);
        assert_eq!(n, 0, "an oversized frame closes the connection");

        // Everyone else is still served.
        same(&v.read(0, 4096).await.unwrap(), &[3; 4096], "read after the garbage");
        v.write(4096, vec![4; 4096]).await.unwrap();
    });
}
