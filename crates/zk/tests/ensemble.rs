//! A real 3-server ZooKeeper ensemble (Debian's `zookeeper` package): the client creates and
//! sets znodes through any server; a follower killed while writes go on comes back, is
//! synchronised by the leader, and serves the latest zxid and data. Skipped (with a note) when
//! Java or ZooKeeper is not installed.

use std::time::{Duration, Instant};

use zk::{srvr, Ensemble, EnsembleOptions, ServerState, ZkClient};

fn installed() -> bool {
    std::path::Path::new(zk::ensemble::DEBIAN_ZOOKEEPER_JAR).exists()
}

async fn zxid(addr: std::net::SocketAddr) -> Option<i64> {
    match srvr(addr, Duration::from_secs(2)).await {
        Ok(ServerState::Serving { zxid, .. }) => Some(zxid),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_catches_up_after_kill() {
    if !installed() {
        eprintln!("skipped: {}", zk::ensemble::INSTALL_HINT);
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("understudy-zk-test-")
        .tempdir()
        .unwrap();
    let mut e = Ensemble::start(EnsembleOptions::new(dir.path().to_path_buf())).unwrap();
    let leader = e.wait_ready(Duration::from_secs(60)).await.unwrap();
    let victim = (leader + 1) % 3;
    let other = (leader + 2) % 3;
    let c = ZkClient::connect(
        e.client_addr(other),
        Duration::from_secs(10),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let first = c.create("/t", b"0").await.unwrap();
    assert!(
        c.create("/t", b"again").await.is_err(),
        "a second create of /t succeeded"
    );
    assert!(
        c.set_data("/missing", b"x").await.is_err(),
        "setData of a missing znode succeeded"
    );
    e.kill(victim).unwrap();
    let mut last = first;
    for i in 1..=50u32 {
        let (z, stat) = c.set_data("/t", i.to_string().as_bytes()).await.unwrap();
        assert!(z > last, "zxids must grow: {z:#x} after {last:#x}");
        assert_eq!(stat.version, i as i32);
        last = z;
    }
    e.restart(victim).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if zxid(e.client_addr(victim)).await.is_some_and(|z| z >= last) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the restarted follower did not catch up; see {}",
            e.log_path(victim).display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let back = ZkClient::connect(
        e.client_addr(victim),
        Duration::from_secs(10),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let (data, stat) = back.get_data("/t").await.unwrap();
    assert_eq!(data.as_deref(), Some(&b"50"[..]));
    assert_eq!(stat.mzxid, last);
}
