//! The shim fails loudly (EIO at open, a line on stderr) when it cannot replicate: no cluster
//! file, or a controller nobody answers at. Files that are not log files are untouched.

mod nearlog_common;

use std::process::Command;

use nearlog_common::{free_port, shim_path};

const SCRIPT: &str = r#"
import os, sys, errno
d = sys.argv[1]
with open(os.path.join(d, "plain.txt"), "w") as f:
    f.write("fine")
try:
    os.open(os.path.join(d, "x.nlog"), os.O_WRONLY | os.O_CREAT, 0o644)
    print("opened")
except OSError as e:
    print("errno", e.errno == errno.EIO)
"#;

fn run(cluster: &std::path::Path, dir: &std::path::Path) -> (String, String) {
    let out = Command::new("python3")
        .arg("-c")
        .arg(SCRIPT)
        .arg(dir)
        .env("LD_PRELOAD", shim_path())
        .env("UNDERSTUDY_NEARLOG_CLUSTER", cluster)
        .env("UNDERSTUDY_NEARLOG_PATTERNS", "*.nlog")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    (String::from_utf8_lossy(&out.stdout).trim().to_string(), String::from_utf8_lossy(&out.stderr).to_string())
}

#[test]
fn missing_cluster_file_or_dead_controller_is_eio_at_open() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, err) = run(&tmp.path().join("no-such-cluster.json"), tmp.path());
    assert_eq!(out, "errno True");
    assert!(err.contains("misconfigured"), "{err}");
    assert_eq!(std::fs::read_to_string(tmp.path().join("plain.txt")).unwrap(), "fine");

    let secret = tmp.path().join("secret");
    std::fs::write(&secret, "s3cret").unwrap();
    let cluster = tmp.path().join("cluster.json");
    let dead = format!("127.0.0.1:{}", free_port());
    std::fs::write(&cluster, format!(r#"{{"controller":"{dead}","secret_file":"{}","peers":[]}}"#, secret.display())).unwrap();
    let (out, err) = run(&cluster, tmp.path());
    assert_eq!(out, "errno True");
    assert!(err.contains("controller"), "{err}");
}
