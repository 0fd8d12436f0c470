//! FUSE tests with the real kernel: they need root, /dev/fuse, and (for attach) losetup,
//! mkfs.ext4 and mount with free loop devices. Set UNDERSTUDY_SKIP_FUSE_TESTS=1 to skip them
//! on a machine that has none of that; otherwise a missing piece fails the test and says what.

use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use blockdev::{BlockDev, DevResult, MemDev};
use fusefile::{attach, detach, mount_with, AttachConfig, MountConfig};

const MIB: u64 = 1 << 20;

/// A MemDev that counts flushes, trims and write-zeroes, to see what the kernel sent.
struct CountingDev {
    inner: MemDev,
    flushes: AtomicU64,
    trims: AtomicU64,
    zeroes: AtomicU64,
    read_delay_ms: u64,
    reads_in_flight: AtomicU64,
    max_reads_in_flight: AtomicU64,
}

impl CountingDev {
    fn new(size_bytes: u64) -> Self {
        CountingDev {
            inner: MemDev::new(size_bytes),
            flushes: 0.into(),
            trims: 0.into(),
            zeroes: 0.into(),
            read_delay_ms: 0,
            reads_in_flight: 0.into(),
            max_reads_in_flight: 0.into(),
        }
    }
}

impl BlockDev for CountingDev {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    async fn read(&self, offset: u64, len: u32) -> DevResult<Vec<u8>> {
        let now = self.reads_in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_reads_in_flight.fetch_max(now, Ordering::SeqCst);
        if self.read_delay_ms > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(self.read_delay_ms)).await;
        }
        let out = self.inner.read(offset, len).await;
        self.reads_in_flight.fetch_sub(1, Ordering::SeqCst);
        out
    }
    async fn write(&self, offset: u64, data: Vec<u8>) -> DevResult<()> {
        self.inner.write(offset, data).await
    }
    async fn flush(&self) -> DevResult<()> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        self.inner.flush().await
    }
    async fn trim(&self, offset: u64, len: u64) -> DevResult<()> {
        self.trims.fetch_add(1, Ordering::SeqCst);
        self.inner.trim(offset, len).await
    }
    async fn write_zeroes(&self, offset: u64, len: u64) -> DevResult<()> {
        self.zeroes.fetch_add(1, Ordering::SeqCst);
        self.inner.write_zeroes(offset, len).await
    }
}

/// Returns false (and says why) if the FUSE tests were asked to be skipped; panics with a
/// clear message if the environment cannot run them.
fn fuse_available() -> bool {
    if std::env::var_os("UNDERSTUDY_SKIP_FUSE_TESTS").is_some() {
        eprintln!("UNDERSTUDY_SKIP_FUSE_TESTS is set: skipping a FUSE test");
        return false;
    }
    assert!(Path::new("/dev/fuse").exists(), "/dev/fuse is missing: FUSE tests cannot run here (set UNDERSTUDY_SKIP_FUSE_TESTS=1 to skip)");
    let uid = std::fs::metadata("/proc/self").unwrap().uid();
    assert_eq!(
        uid, 0,
        "FUSE tests mount file systems and need root (set UNDERSTUDY_SKIP_FUSE_TESTS=1 to skip)"
    );
    true
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fusefile-test-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"));
    assert!(
        out.status.success(),
        "`{cmd} {}` failed: {}\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The tests of this file run one at a time: a test that forks (mkfs, mount, losetup) while
/// another unmounts its FUSE file system lends the child, between fork and exec, a copy of the
/// other's open file, and the unmount then fails with EBUSY.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn one_file_maps_reads_writes_fsync_and_fallocate_to_the_device() {
    let _serial = serial();
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let dev = Arc::new(CountingDev::new(16 * MIB));
    let dir = temp_dir("onefile");
    let fuse = mount_with(
        dev.clone(),
        &dir,
        MountConfig::new("disk.img", rt.handle().clone()),
    )
    .expect("FUSE mount");
    let path = fuse.file_path().to_path_buf();

    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["disk.img"]);
    let meta = std::fs::metadata(&path).unwrap();
    assert!(meta.is_file());
    assert_eq!(meta.len(), 16 * MIB);
    assert!(std::fs::metadata(dir.join("other")).is_err());

    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    file.write_all_at(&[0xab; 8192], 4096).unwrap();
    let flushes_before = dev.flushes.load(Ordering::SeqCst);
    file.sync_all().unwrap();
    assert!(
        dev.flushes.load(Ordering::SeqCst) > flushes_before,
        "fsync did not flush the device"
    );
    assert_eq!(rt.block_on(dev.read(4096, 8192)).unwrap(), vec![0xab; 8192]);
    let mut back = vec![0u8; 8192];
    file.read_exact_at(&mut back, 4096).unwrap();
    assert_eq!(back, vec![0xab; 8192]);

    // Past the end: reads are empty, writes fail with ENOSPC, writes across it are cut short.
    assert_eq!(file.read_at(&mut back, 16 * MIB).unwrap(), 0);
    let err = file.write_at(&[1], 16 * MIB).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    assert_eq!(file.write_at(&[2; 10], 16 * MIB - 4).unwrap(), 4);

    // Punch hole → trim; zero range → write zeroes.
    let p = path.to_str().unwrap();
    run(
        "fallocate",
        &["--punch-hole", "--offset", "4096", "--length", "4096", p],
    );
    assert_eq!(dev.trims.load(Ordering::SeqCst), 1);
    assert_eq!(
        rt.block_on(dev.read(4096, 8192)).unwrap(),
        [vec![0; 4096], vec![0xab; 4096]].concat()
    );
    run(
        "fallocate",
        &[
            "--zero-range",
            "--keep-size",
            "--offset",
            "8192",
            "--length",
            "4096",
            p,
        ],
    );
    assert_eq!(dev.zeroes.load(Ordering::SeqCst), 1);
    assert_eq!(rt.block_on(dev.read(8192, 4096)).unwrap(), vec![0; 4096]);
    // Truncation is refused: the file is a fixed-size device.
    assert!(file.set_len(MIB).is_err());

    // Many I/Os at once from several threads.
    let file = Arc::new(file);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let file = file.clone();
            std::thread::spawn(move || {
                for i in 0..32u64 {
                    let offset = MIB + (t * 32 + i) * 16384;
                    let data = vec![(t * 32 + i) as u8; 16384];
                    file.write_all_at(&data, offset).unwrap();
                    let mut back = vec![0u8; 16384];
                    file.read_exact_at(&mut back, offset).unwrap();
                    assert_eq!(back, data);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    drop(file);
    fuse.unmount().expect("FUSE unmount");
    assert!(!path.exists(), "file still visible after unmount");
    let _ = std::fs::remove_dir(&dir);
}

#[test]
fn attach_ext4_write_fsync_remount_read_back_detach() {
    let _serial = serial();
    if !fuse_available() {
        return;
    }
    for (tool, package) in [
        ("losetup", "mount"),
        ("mkfs.ext4", "e2fsprogs"),
        ("mount", "mount"),
        ("fallocate", "util-linux"),
    ] {
        assert!(
            Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .output()
                .unwrap()
                .status
                .success(),
            "`{tool}` is not installed (Debian package {package})"
        );
    }
    let rt = runtime();
    let dev = Arc::new(CountingDev::new(256 * MIB));
    let mount_dir = temp_dir("ext4");
    let mut config = AttachConfig::new("disk.img", rt.handle().clone());
    config.mkfs_ext4 = true;
    let mut attached = attach(dev.clone(), &mount_dir, config).expect("attach");
    let loop_device = attached.loop_device().unwrap().to_path_buf();
    let loop_name = loop_device.to_string_lossy().into_owned();
    assert!(
        run(
            "findmnt",
            &["-n", "-o", "FSTYPE", mount_dir.to_str().unwrap()]
        )
        .trim()
            == "ext4"
    );
    let dio = std::fs::read_to_string(format!(
        "/sys/block/{}/loop/dio",
        loop_device.file_name().unwrap().to_string_lossy()
    ))
    .unwrap_or_default();
    eprintln!("{loop_name}: direct I/O = {}", dio.trim());

    // Write files, each fsynced.
    let flushes_before = dev.flushes.load(Ordering::SeqCst);
    for i in 0..20u32 {
        let mut f = std::fs::File::create(mount_dir.join(format!("file-{i}"))).unwrap();
        let data: Vec<u8> = (0..(64 * 1024 + i * 1000))
            .map(|b| (b as u8) ^ (i as u8))
            .collect();
        f.write_all(&data).unwrap();
        f.sync_all().unwrap();
    }
    assert!(
        dev.flushes.load(Ordering::SeqCst) > flushes_before,
        "fsync on ext4 never reached the device as a flush"
    );

    // Unmount and mount the loop device again: the data must come back from the device.
    run("umount", &[mount_dir.to_str().unwrap()]);
    run("mount", &[&loop_name, mount_dir.to_str().unwrap()]);
    for i in 0..20u32 {
        let data = std::fs::read(mount_dir.join(format!("file-{i}"))).unwrap();
        let want: Vec<u8> = (0..(64 * 1024 + i * 1000))
            .map(|b| (b as u8) ^ (i as u8))
            .collect();
        assert!(data == want, "file-{i} differs after remount");
    }

    let fuse_dir = attached
        .backing_file()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    attached.detach().expect("detach");
    assert!(!Path::new(&format!(
        "/sys/block/{}/loop",
        loop_device.file_name().unwrap().to_string_lossy()
    ))
    .join("backing_file")
    .exists());
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(
        !mounts.contains(mount_dir.to_str().unwrap()),
        "still mounted:\n{mounts}"
    );
    assert!(
        !mounts.contains(fuse_dir.to_str().unwrap()),
        "the FUSE mount is left:\n{mounts}"
    );
    assert!(!fuse_dir.exists(), "private FUSE directory not removed");
    drop(attached);

    // The ext4 image is still on the device: attach again without mkfs and read a file.
    let attached = attach(
        dev.clone(),
        &mount_dir,
        AttachConfig::new("disk.img", rt.handle().clone()),
    )
    .expect("re-attach");
    let data = std::fs::read(mount_dir.join("file-3")).unwrap();
    assert_eq!(data.len(), 64 * 1024 + 3000);
    detach(attached).expect("detach");
    let _ = std::fs::remove_dir(&mount_dir);
}

#[test]
fn several_reads_are_in_flight_at_once() {
    let _serial = serial();
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let dev = Arc::new(CountingDev {
        read_delay_ms: 200,
        ..CountingDev::new(4 * MIB)
    });
    let dir = temp_dir("concurrent");
    let fuse = mount_with(
        dev.clone(),
        &dir,
        MountConfig::new("disk.img", rt.handle().clone()),
    )
    .expect("FUSE mount");
    let file = Arc::new(std::fs::File::open(fuse.file_path()).unwrap());
    let start = std::time::Instant::now();
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let file = file.clone();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 4096];
                file.read_exact_at(&mut buf, t * 65536).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let max = dev.max_reads_in_flight.load(Ordering::SeqCst);
    eprintln!(
        "8 reads of 200 ms took {:?}, {max} at once",
        start.elapsed()
    );
    assert!(max > 1, "reads were served one at a time");
    drop(file);
    fuse.unmount().expect("FUSE unmount");
    let _ = std::fs::remove_dir(&dir);
}

#[test]
fn failed_attach_undoes_its_steps_and_says_which_failed() {
    let _serial = serial();
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    // A blank device and no mkfs: `mount` finds no file system.
    let dev = Arc::new(MemDev::new(64 * MIB));
    let mount_dir = temp_dir("blank");
    let err = attach(
        dev,
        &mount_dir,
        AttachConfig::new("blank.img", rt.handle().clone()),
    )
    .err()
    .expect("mounting a blank device must fail");
    let msg = err.to_string();
    assert!(
        msg.contains("`mount /dev/loop"),
        "error does not name the failed step: {msg}"
    );
    let loops = run("losetup", &["-a"]);
    assert!(
        !loops.contains("blank.img"),
        "loop device left attached:\n{loops}"
    );
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(
        !mounts.contains(mount_dir.to_str().unwrap()),
        "left mounted:\n{mounts}"
    );
    let _ = std::fs::remove_dir(&mount_dir);
}
