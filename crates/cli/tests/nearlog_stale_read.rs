//! A read-only open of a *stale* local copy of a replicated log file (the application restarted
//! on a machine whose file is older than what the log peers hold, or the page cache lost
//! unsynced data in a machine crash): every write acknowledged through the shim is read back,
//! and only the chunks the stale copy lacks are fetched. Real processes: python3 writers and
//! readers under the shim, `understudy nearlog up`.

mod nearlog_common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use nearlog_common::{Bed, Kill};

/// Appends records `start..start+n` (8 KiB each) with write + fsync, printing each number once
/// fsync returned; then one more record per line on stdin.
const WRITER: &str = r#"
import os, sys
path, start, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def rec(i):
    return (("%08d " % i) + "abcdefgh"[i % 8] * 8182 + "\n").encode()
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
def put(i):
    os.write(fd, rec(i))
    os.fsync(fd)
    print(i, flush=True)
for i in range(start, start + n):
    put(i)
i = start + n
for _ in sys.stdin:
    put(i)
    i += 1
os.close(fd)
"#;

const READER: &str = r#"
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
out = b""
while True:
    b = os.read(fd, 1 << 20)
    if not b:
        break
    out += b
sys.stdout.buffer.write(out)
"#;

const RECORD_BYTES: usize = 8192;

fn record(i: usize) -> Vec<u8> {
    let mut r = format!("{i:08} ").into_bytes();
    r.extend(std::iter::repeat_n(b"abcdefgh"[i % 8], RECORD_BYTES - 10));
    r.push(b'\n');
    r
}

fn shimmed(so: &Path, cluster: &Path, script: &str) -> Command {
    let mut c = Command::new("python3");
    c.arg("-c").arg(script).env("LD_PRELOAD", so).env("UNDERSTUDY_NEARLOG_CLUSTER", cluster).env("UNDERSTUDY_NEARLOG_PATTERNS", "*.log");
    c
}

/// Runs the writer for records `start..start+n` with stdin closed; returns the last number acked.
fn write_records(so: &Path, cluster: &Path, log: &Path, start: usize, n: usize) -> usize {
    let out = shimmed(so, cluster, WRITER).arg(log).arg(start.to_string()).arg(n.to_string()).stdin(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "writer failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().last().unwrap().parse().unwrap()
}

/// A read-only open and read of the whole file in a new process: (content, shim's stderr).
fn read_all(so: &Path, cluster: &Path, log: &Path) -> (Vec<u8>, String) {
    let out = shimmed(so, cluster, READER).arg(log).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "reader failed: {err}");
    (out.stdout, err)
}

fn expected(n: usize) -> Vec<u8> {
    (0..n).flat_map(record).collect()
}

/// The `(fetched, verified)` byte counts of the shim's "recovered ... for reading" line.
fn repair_counts(stderr: &str) -> Option<(u64, u64)> {
    let line = stderr.lines().find(|l| l.contains("for reading"))?;
    let tail = &line[line.rfind('(')? + 1..];
    let mut nums = tail.split(|c: char| !c.is_ascii_digit()).filter(|s| !s.is_empty()).map(|s| s.parse::<u64>().unwrap());
    Some((nums.next()?, nums.next()?))
}

#[test]
fn a_read_only_open_of_a_stale_local_copy_reads_every_acknowledged_write() {
    let bed = Bed::new();
    let (so, cluster) = (&bed.so, &bed.cluster_file);
    let log = bed.app.join("wal.log");

    // 400 records (3.1 MiB), then a copy of the local file as it was; 200 more records after it.
    assert_eq!(write_records(so, cluster, &log, 0, 400), 399);
    let old = std::fs::read(&log).unwrap();
    assert_eq!(old, expected(400));
    assert_eq!(write_records(so, cluster, &log, 400, 200), 599);

    // The machine's copy goes back to the older one; a new process opens it read-only.
    std::fs::write(&log, &old).unwrap();
    let (got, err) = read_all(so, cluster, &log);
    assert!(got == expected(600), "read {} bytes, {} acknowledged", got.len(), 600 * RECORD_BYTES);
    let (fetched, verified) = repair_counts(&err).unwrap_or_else(|| panic!("no repair logged: {err}"));
    // Chunks 0..2 (3 MiB) of the old copy match the peers' checksums: taken locally.
    assert_eq!(verified, 3 << 20, "{err}");
    assert_eq!(fetched + verified, (600 * RECORD_BYTES) as u64, "{err}");
    assert_eq!(std::fs::read(&log).unwrap(), expected(600), "the local copy was repaired");

    // Current now: read again, nothing repaired.
    let (got, err) = read_all(so, cluster, &log);
    assert!(got == expected(600));
    assert!(repair_counts(&err).is_none(), "a current copy is not rewritten: {err}");

    // A stale copy whose middle was also lost (zeros, as after a crash lost dirty pages).
    let mut damaged = old.clone();
    damaged[(1 << 20) + 100..(1 << 20) + 9000].fill(0);
    std::fs::write(&log, &damaged).unwrap();
    let (got, err) = read_all(so, cluster, &log);
    assert!(got == expected(600), "damaged copy: read {} bytes", got.len());
    assert_eq!(repair_counts(&err).map(|c| c.1), Some(2 << 20), "chunks 0 and 2 verified locally: {err}");

    // A reader beside a live writer on this machine neither waits for nor fences it.
    let mut w = shimmed(so, cluster, WRITER);
    w.arg(&log).arg("600").arg("1").stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut writer: Kill = Kill(w.spawn().unwrap());
    let mut acks = BufReader::new(writer.0.stdout.take().unwrap()).lines();
    assert_eq!(acks.next().unwrap().unwrap(), "600");
    let (got, _) = read_all(so, cluster, &log);
    assert!(got == expected(601));
    more(&mut writer.0);
    assert_eq!(acks.next().unwrap().unwrap(), "601", "the writer goes on after the read");
    drop(writer);
    let (got, _) = read_all(so, cluster, &log);
    assert!(got == expected(602));
}

fn more(c: &mut Child) {
    let stdin = c.stdin.as_mut().unwrap();
    stdin.write_all(b"\n").unwrap();
    stdin.flush().unwrap();
}

/// Opens the log for appending, appends 10 bytes with fsync, closes; prints the bytes the
/// process read (`rchar`) during the open alone.
const APPENDER: &str = r#"
import os, sys
def rchar():
    return int([l for l in open("/proc/self/io") if l.startswith("rchar")][0].split()[1])
a = rchar()
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)
b = rchar()
os.write(fd, b"x" * 10)
os.fsync(fd)
os.close(fd)
print(b - a)
"#;

fn append_read_bytes(so: &Path, cluster: &Path, log: &Path) -> u64 {
    let out = shimmed(so, cluster, APPENDER).arg(log).output().unwrap();
    assert!(out.status.success(), "appender failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().parse().unwrap()
}

#[test]
fn a_writer_open_of_a_copy_a_writer_closed_current_reads_none_of_it() {
    let bed = Bed::new();
    let (so, cluster) = (&bed.so, &bed.cluster_file);
    let log = bed.app.join("wal.log");
    assert_eq!(write_records(so, cluster, &log, 0, 400), 399);
    let size = 400 * RECORD_BYTES as u64;

    // The writer closed with every write acknowledged: the next writer (another process) takes
    // the local copy as the peers' state without reading it.
    let read = append_read_bytes(so, cluster, &log);
    assert!(read < 1 << 20, "a known-current copy of {size} bytes was read at open ({read} bytes)");
    let mut want = expected(400);
    want.extend_from_slice(&[b'x'; 10]);
    assert!(read_all(so, cluster, &log).0 == want);

    // Rewritten outside the shim (same bytes, but nothing vouches for them now): read and
    // checked against the peers at open.
    std::fs::write(&log, std::fs::read(&log).unwrap()).unwrap();
    let read = append_read_bytes(so, cluster, &log);
    assert!(read >= size, "a copy changed behind the shim's back must be read at open ({read} bytes)");
    want.extend_from_slice(&[b'x'; 10]);

    // Damaged behind the shim's back (zeros where a crash lost dirty pages, same size):
    // repaired from the peers at the writer's open, whatever was remembered.
    let mut damaged = std::fs::read(&log).unwrap();
    damaged[4096..8192].fill(0);
    std::fs::write(&log, &damaged).unwrap();
    let read = append_read_bytes(so, cluster, &log);
    want.extend_from_slice(&[b'x'; 10]);
    let got = std::fs::read(&log).unwrap();
    let diff = got.iter().zip(&want).position(|(a, b)| a != b);
    assert!(got == want, "the writer's open repaired the local copy: {} bytes, {} wanted, first difference at {diff:?}; {read} read at open", got.len(), want.len());
    assert!(read_all(so, cluster, &log).0 == want);
}
