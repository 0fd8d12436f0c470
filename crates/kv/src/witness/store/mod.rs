//! The backup's storage tiers (paper §3.2, Fig 4; spec (c) "Honest tier emulation"), as plain
//! libraries the witness driver calls. No protocol decision is made here: what to append,
//! when to free, what to read and at which priority is the core's; these modules only make it
//! durable, fast and honest on this machine.
//!
//! - [`pmem`]: the NVMM buffer, a bounded ring of crc-framed records in a `/dev/shm` mapping
//!   (survives SIGKILL, **not** power loss) or an `O_DSYNC` file (power-safe, ~100 µs/persist).
//! - [`ssdlog`]: the hot and cold SSD logs, `O_DIRECT` segments of 4 KiB pages in the core's
//!   one format ([`core::page`](crate::witness::core::page)), scanned at open.
//! - [`io`]: the SSD I/O pool, priority classes PriorityPull > Writeback > BatchPull > Gc (the
//!   core's [`IoClass`](crate::witness::core::ssd::IoClass)) with per-class in-flight limits
//!   and a BatchPull token bucket.
//! - [`TierBytes`]: what each structure holds per tier, for the cost model.
//!
//! # Driving it from the core's outputs
//!
//! The driver owns the NVMM regions, one `Arc<`[`ssdlog::SsdLogs`]`>` and one [`io::IoPool`]
//! over it. The core decides every segment, offset and free (it owns the index and the live
//! byte counts, `core::ssd`); the outputs map one to one:
//!
//! | core output | pool request | completion fed back |
//! |---|---|---|
//! | `SsdWrite{id, seg, log, off, bytes, class}` | `IoOp::Write{seg, kind: log, off, bytes}` in `class` (Writeback, or Gc for GC rewrites) | `SsdWritten{id}` once `fdatasync`ed |
//! | `SsdRead{id, seg, off, len, class}` | `IoOp::Read{seg, off, len}` in `class` | `SsdRead{id, bytes}` (the core decodes) |
//! | `SsdFree{seg}` | `IoOp::Delete{seg}` in Gc | none |
//!
//! At a restart [`ssdlog::SsdLogs::open`] scans the segments and hands their valid bytes to
//! `WitnessCore::restore`, which rebuilds the index with the live rule (the stamp never
//! decreases), so a replayed NVMM entry already written back is harmless.

pub mod io;
pub mod pmem;
pub mod ssdlog;

/// Bytes a structure holds, by tier, for the cost model (DRAM $35.16, NVMM $4.51, SSD $0.32
/// per GB, paper Fig 1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierBytes {
    /// Emulated NVMM (shm or dsync files), as provisioned.
    pub nvmm: u64,
    /// SSD log segments: their durable pages.
    pub ssd: u64,
    /// DRAM spent on indexes over the other tiers (estimated from entry counts and sizes).
    pub dram_index: u64,
}

impl std::ops::Add for TierBytes {
    type Output = TierBytes;
    fn add(self, o: TierBytes) -> TierBytes {
        TierBytes {
            nvmm: self.nvmm + o.nvmm,
            ssd: self.ssd + o.ssd,
            dram_index: self.dram_index + o.dram_index,
        }
    }
}

impl std::iter::Sum for TierBytes {
    fn sum<I: Iterator<Item = TierBytes>>(it: I) -> TierBytes {
        it.fold(TierBytes::default(), |a, b| a + b)
    }
}

#[cfg(test)]
mod tests {
    use super::pmem::{PmemConfig, PmemMode, PmemRegion};
    use super::ssdlog::{LogKind, LogTs, SsdConfig, SsdEntry, SsdLogs};
    use std::io::{BufRead, Write};
    use std::path::Path;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    const CHILD_ENV: &str = "UNDERSTUDY_STORE_SIGKILL_CHILD";
    const TEST: &str = "witness::store::tests::pmem_and_ssdlog_survive_sigkill_of_the_writer";
    const PMEM_CAP_BYTES: u64 = 4 << 20;
    /// The child stops appending to pmem here, far below a full region.
    const PMEM_RECORDS_MAX: u64 = 20_000;

    fn pmem_payload(seq: u64) -> Vec<u8> {
        format!("record {seq} ")
            .repeat(1 + (seq % 7) as usize)
            .into_bytes()
    }

    fn ssd_entry(index: u64) -> SsdEntry {
        SsdEntry {
            key: format!("key{}", index % 50).into_bytes(),
            ts: LogTs { term: 1, index },
            value: vec![index as u8; 300 + (index % 1000) as usize],
        }
    }

    fn open(
        shm: &Path,
        disk: &Path,
    ) -> (
        PmemRegion,
        SsdLogs,
        std::collections::HashMap<Vec<u8>, (LogTs, super::ssdlog::Loc)>,
    ) {
        let cfg = PmemConfig {
            mode: PmemMode::Shm,
            capacity_bytes: PMEM_CAP_BYTES,
            persist_ns: 0,
        };
        let region = PmemRegion::open(&shm.join("buf"), &cfg).unwrap();
        let (logs, segs) = SsdLogs::open(disk, SsdConfig::default()).unwrap();
        (region, logs, super::ssdlog::tests::newest_of(&segs))
    }

    /// The writer: prints `p <seq>` once a pmem append returned and `s <index>` once an SSD
    /// batch did; it ends by itself after 60 s, or when its stdout (the parent) is gone.
    fn child(shm: &Path, disk: &Path) {
        let (mut region, logs, _) = open(shm, disk);
        let mut out = std::io::stdout().lock();
        let t0 = Instant::now();
        let (mut seq, mut index) = (0u64, 0u64);
        while t0.elapsed() < Duration::from_secs(60) {
            if seq < PMEM_RECORDS_MAX {
                seq += 1;
                region.append(seq, &pmem_payload(seq)).unwrap();
                if writeln!(out, "p {seq}").and_then(|()| out.flush()).is_err() {
                    return;
                }
            }
            if seq % 10 == 0 || seq >= PMEM_RECORDS_MAX {
                let batch: Vec<SsdEntry> = (index + 1..=index + 3).map(ssd_entry).collect();
                logs.append(LogKind::Cold, &batch).unwrap();
                index += 3;
                if writeln!(out, "s {index}")
                    .and_then(|()| out.flush())
                    .is_err()
                {
                    return;
                }
            }
        }
    }

    struct KillOnDrop(Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// The shm emulation's claim (survives SIGKILL) and the SSD log's (an acknowledged batch
    /// is durable), checked on a real process killed with SIGKILL mid-stream: every record and
    /// batch it reported as persisted is found, whole, after a reopen.
    #[test]
    fn pmem_and_ssdlog_survive_sigkill_of_the_writer() {
        if let Ok(dirs) = std::env::var(CHILD_ENV) {
            let (shm, disk) = dirs.split_once('\n').unwrap();
            child(Path::new(shm), Path::new(disk));
            return;
        }
        let shm = tempfile::tempdir_in(PmemRegion::shm_dir()).unwrap();
        let disk = super::ssdlog::tests::disk_dir();
        let dirs = format!("{}\n{}", shm.path().display(), disk.path().display());
        let mut c = KillOnDrop(
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
                .env(CHILD_ENV, dirs)
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let lines = std::io::BufReader::new(c.0.stdout.take().unwrap()).lines();
        let (mut last_p, mut last_s) = (0u64, 0u64);
        for line in lines {
            let line = line.unwrap();
            match line.split_once(' ') {
                Some(("p", n)) => last_p = n.parse().unwrap(),
                Some(("s", n)) => last_s = n.parse().unwrap(),
                _ => continue, // the test harness's own lines
            }
            if last_p >= 500 && last_s >= 60 {
                break;
            }
        }
        assert!(
            last_p >= 500 && last_s >= 60,
            "the writer stopped early: p {last_p} s {last_s}"
        );
        // SAFETY: kill(2) on our own child's pid, which it keeps until we wait for it.
        assert_eq!(unsafe { libc::kill(c.0.id() as i32, libc::SIGKILL) }, 0);
        let status = c.0.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
        let (region, logs, idx) = open(shm.path(), disk.path());
        // Records 1..=n, contiguous, each whole, n at least what the writer reported.
        let got: Vec<(u64, Vec<u8>)> = region.iter().map(|(s, p)| (s, p.to_vec())).collect();
        assert!(got.len() as u64 >= last_p, "{} < {last_p}", got.len());
        for (i, (s, p)) in got.iter().enumerate() {
            assert_eq!(*s, i as u64 + 1);
            assert_eq!(*p, pmem_payload(*s));
        }
        // Every reported SSD batch: key i % 50 holds version i, i + 50, ...; the index has the
        // newest reported one or a newer (written, unreported) one, and it reads back whole.
        for i in 1..=last_s {
            let key = ssd_entry(i).key;
            let ie = idx.get(&key).expect("every reported key is indexed");
            let newest_reported = i + (last_s - i) / 50 * 50;
            assert!(ie.0.index >= newest_reported, "{ie:?} < {newest_reported}");
            assert_eq!(
                logs.read_entry(ie.1).unwrap(),
                ssd_entry(ie.0.index).to_entry()
            );
        }
    }
}
