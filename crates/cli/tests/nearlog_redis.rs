//! Redis (appendonly yes, appendfsync always) under the nearlog LD_PRELOAD shim: loaded with
//! SETs through a tiny RESP client, killed with SIGKILL mid-load, restarted against an empty
//! local directory into which only the bulk files (manifest, base RDB) are copied back from
//! "storage"; every acknowledged SET must be there. Needs redis-server.

mod nearlog_common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nearlog_common::{free_port, shim_path, start_cluster, Kill};

struct Resp {
    w: TcpStream,
    r: BufReader<TcpStream>,
}

impl Resp {
    fn connect(port: u16) -> Resp {
        let start = Instant::now();
        loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => return Resp { r: BufReader::new(s.try_clone().unwrap()), w: s },
                Err(_) if start.elapsed() < Duration::from_secs(30) => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => panic!("redis not reachable: {e}"),
            }
        }
    }
    fn cmd(&mut self, args: &[&str]) -> String {
        let mut m = format!("*{}\r\n", args.len());
        for a in args {
            m += &format!("${}\r\n{a}\r\n", a.len());
        }
        self.w.write_all(m.as_bytes()).unwrap();
        let mut line = String::new();
        self.r.read_line(&mut line).unwrap();
        if let Some(n) = line.strip_prefix('$') {
            let n: i64 = n.trim().parse().unwrap();
            if n < 0 {
                return "(nil)".into();
            }
            let mut v = String::new();
            self.r.read_line(&mut v).unwrap();
            return v.trim_end().to_string();
        }
        line.trim_end().to_string()
    }
}

fn redis(dir: &Path, port: u16, so: &Path, cluster: &Path) -> Kill {
    let mut c = Command::new("redis-server");
    c.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--dir"])
        .arg(dir)
        .args(["--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no", "--logfile", ""])
        .env("LD_PRELOAD", so)
        .env("UNDERSTUDY_NEARLOG_CLUSTER", cluster)
        .env("UNDERSTUDY_NEARLOG_PATTERNS", "*.incr.aof")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    Kill(c.spawn().unwrap())
}

fn copy_bulk(from: &Path, to: &Path) {
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().to_string();
        let target = to.join(&name);
        if e.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&target).unwrap();
            copy_bulk(&e.path(), &target);
        } else if !name.ends_with(".incr.aof") {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

#[test]
fn redis_aof_always_survives_sigkill_and_an_empty_local_directory() {
    let so = shim_path();
    let tmp = tempfile::tempdir().unwrap();
    let (_cluster, cluster_file) = start_cluster(&tmp.path().join("cluster"));
    let app = tmp.path().join("app");
    std::fs::create_dir_all(&app).unwrap();
    let port = free_port();
    let mut server = redis(&app, port, &so, &cluster_file);
    let mut c = Resp::connect(port);
    let mut acked = 0u64;
    let start = Instant::now();
    while acked < 2000 && start.elapsed() < Duration::from_secs(60) {
        let i = acked + 1;
        if c.cmd(&["SET", &format!("k{i}"), &format!("v{i}")]) != "+OK" {
            break;
        }
        acked = i;
    }
    // SIGKILL mid-load: one more SET in flight.
    c.w.write_all(b"*3\r\n$3\r\nSET\r\n$5\r\nlastx\r\n$1\r\n1\r\n").unwrap();
    unsafe { libc::kill(server.0.id() as i32, libc::SIGKILL) };
    let _ = server.0.wait();
    drop(server);
    assert!(acked >= 2000, "only {acked} SETs acknowledged");

    let old = tmp.path().join("old-app");
    std::fs::rename(&app, &old).unwrap();
    std::fs::create_dir_all(&app).unwrap();
    copy_bulk(&old, &app);

    let _server = redis(&app, port, &so, &cluster_file);
    let mut c = Resp::connect(port);
    let start = Instant::now();
    while c.cmd(&["PING"]).starts_with("-LOADING") && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    for i in 1..=acked {
        assert_eq!(c.cmd(&["GET", &format!("k{i}")]), format!("v{i}"), "acknowledged SET k{i} lost ({acked} acknowledged)");
    }
}
