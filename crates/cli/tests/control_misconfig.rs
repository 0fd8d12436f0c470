//! Issue 24 item 9, for the daemons themselves (the store's own behaviour is in
//! `crates/control/tests/etcd.rs`): the metadata service, the kv CM and the nearlog controller,
//! started on an etcd nobody answers at, or on one whose keys belong to another cluster, exit
//! with a clear error instead of hanging or sharing the keys.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a daemon may take to give up: the store's open timeout is 5 s; generous for a
/// loaded machine, far below a hang.
const EXIT_BOUND: Duration = Duration::from_secs(40);

/// Kills and reaps on drop.
struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// (name, arguments) of the three control daemons on store `url`, in `dir`.
fn daemons(url: &str, dir: &std::path::Path) -> Vec<(&'static str, Vec<String>)> {
    let sf = dir.join("secret").display().to_string();
    let port = || format!("127.0.0.1:{}", wire::ports::free_loopback_port().unwrap());
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    vec![
        (
            "volume meta",
            s(&[
                "volume",
                "meta",
                "--store",
                url,
                "--listen",
                &port(),
                "--secret-file",
                &sf,
            ]),
        ),
        (
            "kv cm",
            s(&[
                "kv",
                "cm",
                "--nodes",
                &format!("0={},1={}", port(), port()),
                "--secret-file",
                &sf,
                "--store",
                url,
            ]),
        ),
        (
            "nearlog controller",
            s(&[
                "nearlog",
                "controller",
                "--listen",
                &port(),
                "--store",
                url,
                "--dir",
                &dir.join("ctl").display().to_string(),
                "--secret-file",
                &sf,
            ]),
        ),
    ]
}

/// Starts every daemon; each must exit unsuccessfully within [`EXIT_BOUND`] with a message
/// containing `want`. Returns each one's time to exit.
fn each_exits_with(url: &str, dir: &std::path::Path, want: &str) -> Vec<(&'static str, Duration)> {
    let started = Instant::now();
    let mut running: Vec<(&str, std::path::PathBuf, Kill)> = daemons(url, dir)
        .into_iter()
        .map(|(name, args)| {
            let log = dir.join(format!("{}.log", name.replace(' ', "-")));
            let f = std::fs::File::create(&log).unwrap();
            let child = Command::new(env!("CARGO_BIN_EXE_understudy"))
                .args(&args)
                .stdin(Stdio::null())
                .stdout(f.try_clone().unwrap())
                .stderr(f)
                .spawn()
                .unwrap();
            (name, log, Kill(child))
        })
        .collect();
    let mut took = vec![];
    for (name, log, k) in &mut running {
        let status = loop {
            if let Some(st) = k.0.try_wait().unwrap() {
                break st;
            }
            assert!(
                started.elapsed() < EXIT_BOUND,
                "{name} still runs {EXIT_BOUND:?} after it started: {}",
                std::fs::read_to_string(&*log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let said = std::fs::read_to_string(&*log).unwrap_or_default();
        assert!(!status.success(), "{name} exited successfully: {said}");
        assert!(said.contains(want), "{name} did not say {want:?}: {said}");
        took.push((*name, started.elapsed()));
    }
    took
}

fn secret_dir() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("secret"),
        format!("misconfig-{}-{:?}", std::process::id(), Instant::now()),
    )
    .unwrap();
    std::fs::set_permissions(
        tmp.path().join("secret"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    tmp
}

#[test]
fn daemons_on_an_unreachable_etcd_exit_with_a_clear_error() {
    let tmp = secret_dir();
    // A port nothing listens on.
    let url = format!(
        "etcd://127.0.0.1:{}",
        wire::ports::free_loopback_port().unwrap()
    );
    for (name, took) in each_exits_with(&url, tmp.path(), "etcd unreachable") {
        eprintln!(
            "{name}: exited {} ms after start on an unreachable etcd",
            took.as_millis()
        );
    }
}

#[test]
fn daemons_on_another_clusters_keys_refuse() {
    let etcd = testbed::etcd::EtcdCluster::start(1).expect("etcd starts");
    let tmp = secret_dir();
    // Another cluster claimed each system's keys first (same cluster names, another id).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for cluster in ["volume", "kv", "nearlog"] {
        rt.block_on(control::Store::open(
            &etcd.url(),
            cluster,
            "another-cluster-id",
        ))
        .unwrap();
    }
    each_exits_with(&etcd.url(), tmp.path(), "refusing to share it");
    // Their keys are untouched: the other cluster still opens its store.
    for cluster in ["volume", "kv", "nearlog"] {
        rt.block_on(control::Store::open(
            &etcd.url(),
            cluster,
            "another-cluster-id",
        ))
        .unwrap();
    }
}
