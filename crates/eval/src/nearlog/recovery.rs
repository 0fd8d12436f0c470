//! `bench nearlog recovery` (SplitFT, "Application recovery time with 60MB of log"): a log
//! recovered from the peers against one read from the volume, and RocksDB's restart.

use super::*;

/// Writes N bytes to a log file in 64 KiB appends (each replicated), then exits.
const LOG_WRITE: &str = r#"
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
n = int(sys.argv[2])
chunk = bytes(range(256)) * 256
done = 0
while done < n:
    k = min(len(chunk), n - done)
    os.write(fd, chunk[:k])
    done += k
os.fsync(fd)
os.close(fd)
"#;

/// Opens a log file read-only (the shim recovers a missing one first), reads it all; prints the open's
/// and the read's seconds and the size.
const LOG_OPEN: &str = r#"
import os, sys, time
t0 = time.perf_counter()
fd = os.open(sys.argv[1], os.O_RDONLY)
t1 = time.perf_counter()
n = 0
while True:
    b = os.read(fd, 1 << 20)
    if not b:
        break
    n += len(b)
t2 = time.perf_counter()
print(t1 - t0, t2 - t1, n)
"#;

pub fn run(a: RecoveryBenchArgs) -> anyhow::Result<bench::Report> {
    let c = &a.common;
    let out = bench::out_dir("nearlog", c.out.clone())?;
    let tmp = tempfile::Builder::new().prefix("nearlog-bench-").tempdir_in(std::env::current_dir()?)?;
    let rocks = build_rocksdb_load(tmp.path())?;
    let rt = crate::runtime()?;
    let rounds = c.rounds.unwrap_or(if c.quick { 1 } else { 3 }).max(1);
    let mut report = bench::Report::new("nearlog.recovery", c.quick);
    let mb = a.log_bytes as f64 / 1e6;
    let mut csv = vec![];
    for latency in settings(c) {
        // Quick: a smaller volume (mkfs and attach take less); 2 GiB still holds every file.
        let tb = Testbed::start(c, &rt, tmp.path(), latency, if c.quick { "2G" } else { "4G" })?;
        let pfx = latency.prefix();
        let mut log_s = vec![];
        let mut vol_s = vec![];
        let mut rocks_near = vec![];
        let mut rocks_strong = vec![];
        let mut rocks_opendir = vec![];
        for round in 0..rounds {
            // (1) The log alone: written through the shim, local copy lost, recovered at open.
            let dir = tb.run_dir("log")?;
            let local = tmp.path().join(format!("local-{}", latency.name()));
            let _ = std::fs::remove_dir_all(&local);
            std::fs::create_dir_all(&local)?;
            let f = local.join("app.nlog").display().to_string();
            python(Some((&tb, "*.nlog")), LOG_WRITE, &[f.clone(), a.log_bytes.to_string()])?;
            std::fs::remove_file(&f)?;
            let line = python(Some((&tb, "*.nlog")), LOG_OPEN, std::slice::from_ref(&f))?;
            let v: Vec<f64> = line.split_whitespace().map(|x| x.parse().unwrap_or(f64::NAN)).collect();
            anyhow::ensure!(v.len() == 3 && v[2] as u64 == a.log_bytes, "recovered {line} instead of {} bytes", a.log_bytes);
            // Unlink through the shim frees the peers' memory for the next round.
            python(Some((&tb, "*.nlog")), "import os,sys; os.unlink(sys.argv[1])", &[f])?;
            // (2) The same bytes read from the volume, cold: written through the volume client
            // path (the file system on the volume), then read with O_DIRECT.
            let vf = dir.join("bulk.bin");
            python(None, LOG_WRITE, &[vf.display().to_string(), a.log_bytes.to_string()])?;
            let read_s = read_direct_s(&vf)?;
            let _ = std::fs::remove_dir_all(&dir);
            eprintln!("[{}] round {round}: {mb:.0} MB log recovered from the peers in {:.3} s (+ read {:.3} s); read from storage (O_DIRECT) in {read_s:.3} s", tb.what(), v[0], v[1]);
            log_s.push(v[0]);
            vol_s.push(read_s);

            // (3) RocksDB with a WAL of that size: restart time, nearlog (empty local WAL
            // directory, restored from the peers: by `nearlog restore` first, or by the shim
            // when RocksDB lists the directory) vs strong (WAL on the storage).
            for (s, restore) in [(Setup::Nearlog, true), (Setup::Nearlog, false), (Setup::Strong, false)] {
                let d = tb.run_dir(&format!("rocks-rec-{}", s.name()))?;
                let db = d.join("db");
                let wal = if s == Setup::Nearlog { local.join("wal") } else { d.join("wal") };
                let _ = std::fs::remove_dir_all(&wal);
                std::fs::create_dir_all(&wal)?;
                let pat = format!("{}/*.log", wal.display());
                let mut cmd = app_command(&rocks);
                // The fill is not measured: with --quick its synced batches are larger (fewer
                // syncs on the volume for strong); the WAL to replay is the same size.
                let batch = if c.quick { "1024" } else { "64" };
                cmd.arg("fill").arg(&db).arg(&wal).args([a.log_bytes.to_string(), "1000".to_string(), batch.to_string()]).stdout(Stdio::piped());
                if s == Setup::Nearlog {
                    tb.shim_env(&mut cmd, &pat);
                }
                let mut child = KillOnDrop(cmd.spawn()?);
                let mut l = String::new();
                BufReader::new(child.0.stdout.take().unwrap()).read_line(&mut l)?;
                anyhow::ensure!(l.trim() == "filled", "RocksDB fill failed");
                drop(child); // SIGKILL
                // A restart elsewhere reads the storage cold: drop this machine's cached pages
                // of the (synced, so clean) files.
                drop_cached(&db);
                drop_cached(&wal);
                let t0 = Instant::now();
                if s == Setup::Nearlog {
                    std::fs::remove_dir_all(&wal)?;
                    std::fs::create_dir_all(&wal)?;
                }
                if restore {
                    let o = Command::new(std::env::current_exe()?)
                        .args(["nearlog", "restore", "--cluster"])
                        .arg(&tb.log.cluster_file)
                        .arg("--shim")
                        .arg(&tb.shim)
                        .arg(&wal)
                        .output()?;
                    anyhow::ensure!(o.status.success(), "nearlog restore: {}", String::from_utf8_lossy(&o.stderr));
                }
                let mut cmd = app_command(&rocks);
                cmd.arg("open").arg(&db).arg(&wal);
                if s == Setup::Nearlog {
                    tb.shim_env(&mut cmd, &pat);
                }
                let o = output_bounded(&mut cmd)?;
                anyhow::ensure!(o.status.success(), "RocksDB reopen: {}", String::from_utf8_lossy(&o.stderr));
                let total = t0.elapsed().as_secs_f64();
                let how = match (s, restore) {
                    (Setup::Nearlog, true) => "nearlog (restore, then open)",
                    (Setup::Nearlog, false) => "nearlog (open alone)",
                    _ => s.name(),
                };
                eprintln!("[{}] round {round}: RocksDB {how} restart with a {mb:.0} MB WAL: {total:.3} s ({})", tb.what(), String::from_utf8_lossy(&o.stdout).trim());
                if s == Setup::Nearlog && !restore {
                    rocks_opendir.push(total);
                } else if s == Setup::Nearlog {
                    rocks_near.push(total);
                } else {
                    rocks_strong.push(total);
                }
                tb.remove_run_dir(&wal, s, &pat)?;
                let _ = std::fs::remove_dir_all(&d);
            }
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            v[v.len() / 2]
        };
        let (l, r, rn, rs) = (med(&mut log_s), med(&mut vol_s), med(&mut rocks_near), med(&mut rocks_strong));
        let ro = med(&mut rocks_opendir);
        let size = format!("{}mb", mb.round());
        report.figure(&format!("{pfx}nearlog.log_{size}.recovery_s"), l)?;
        report.figure(&format!("{pfx}volume.read_{size}.duration_s"), r)?;
        report.ratio(&format!("{pfx}nearlog_recovery_vs_volume_read.log_{size}.duration"), l, r)?;
        report.figure(&format!("{pfx}rocksdb.nearlog.wal_{size}.restart_s"), rn)?;
        report.figure(&format!("{pfx}rocksdb.strong.wal_{size}.restart_s"), rs)?;
        report.ratio(&format!("{pfx}nearlog_vs_strong.rocksdb.wal_{size}.restart"), rn, rs)?;
        // Without `nearlog restore`: the shim recovers the WAL when RocksDB lists its directory.
        report.figure(&format!("{pfx}rocksdb.nearlog_open_alone.wal_{size}.restart_s"), ro)?;
        report.ratio(&format!("{pfx}nearlog_open_alone_vs_strong.rocksdb.wal_{size}.restart"), ro, rs)?;
        csv.push(vec![latency.name().into(), format!("{l:.4}"), format!("{r:.4}"), format!("{rn:.4}"), format!("{rs:.4}"), format!("{ro:.4}")]);
        bench::bar_plot(
            &out.join(format!("recovery-60mb-{}", latency.name())),
            &format!("Recovery with {mb:.0} MB of log, {}", tb.what()),
            "",
            "seconds",
            &["log from peers vs read from volume", "RocksDB restart"],
            &[bench::BarSeries { name: "nearlog".into(), values: vec![l, rn] }, bench::BarSeries { name: "volume / strong".into(), values: vec![r, rs] }],
        )?;
    }
    bench::write_csv(&out.join("recovery.csv"), &["latency", "nearlog_log_s", "volume_read_s", "rocksdb_nearlog_s", "rocksdb_strong_s", "rocksdb_nearlog_open_alone_s"], csv)?;
    Ok(report)
}

/// Drops the page cache of every file directly in `dir` (POSIX_FADV_DONTNEED; clean pages only).
fn drop_cached(dir: &Path) {
    use std::os::fd::AsRawFd;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if let Ok(f) = std::fs::File::open(e.path()) {
            // SAFETY: fadvise on an fd we own; it only drops clean cached pages.
            unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
    }
}

/// Reads a file with O_DIRECT (1 MiB requests, past the page cache); seconds.
fn read_direct_s(path: &Path) -> anyhow::Result<f64> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path)?;
    const CHUNK: usize = 1 << 20;
    // O_DIRECT needs an aligned buffer: over-allocate and align by hand.
    let mut raw = vec![0u8; CHUNK + 4096];
    let off = raw.as_ptr().align_offset(4096);
    let buf = &mut raw[off..off + CHUNK];
    let t0 = Instant::now();
    let mut pos = 0u64;
    loop {
        use std::os::unix::fs::FileExt;
        let n = f.read_at(buf, pos)?;
        if n == 0 {
            break;
        }
        pos += n as u64;
    }
    Ok(t0.elapsed().as_secs_f64())
}
