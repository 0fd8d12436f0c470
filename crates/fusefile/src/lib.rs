//! A one-file FUSE export of a [`blockdev::BlockDev`], and the attach path that turns it into a
//! mounted file system: FUSE file → loop device (`losetup --direct-io=on`) → optional
//! `mkfs.ext4` → `mount`.
//!
//! The FUSE file system ([`mount`], [`mount_with`]) has a root directory holding exactly one
//! regular file (e.g. `disk.img`) whose size is the device's size. Reads and writes go to the
//! device; `fsync` and `flush` (close) become a device flush; `fallocate` with PUNCH_HOLE becomes
//! a trim and ZERO_RANGE a write-zeroes, which is what a loop device sends for discards and
//! write-zeroes. It uses the `fuser` crate without libfuse (`default-features = false`), which
//! mounts through `/dev/fuse` directly when run as root. fuser calls the file system from a
//! session thread; each I/O is spawned onto a tokio runtime and replied to when the device
//! answers, so up to [`MountConfig::max_in_flight_ios`] I/Os are in flight at once.
//!
//! Main types: [`FuseMount`] (a mounted session; unmounted on drop or by
//! [`FuseMount::unmount`]), [`Attached`] (the whole stack, made by [`attach`] and taken down,
//! in reverse order, by [`detach`] / [`Attached::detach`]), and [`FuseError`], whose messages say
//! which step failed and how.
//!
//! The runtime must be multi-threaded, and nothing may do blocking file I/O on the mount from
//! one of its worker threads (the I/O would wait on tasks that thread cannot run): call
//! [`attach`], [`detach`] and file operations from plain threads or `spawn_blocking`.

use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use blockdev::{BlockDev, DevError};
use fuser::{
    BackgroundSession, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, KernelConfig, LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request,
    WriteFlags,
};
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::Semaphore;
use tracing::{debug, warn};

const ROOT_INO: INodeNo = INodeNo(1);
const FILE_INO: INodeNo = INodeNo(2);
/// How long the kernel may cache names and attributes (they never change while mounted).
const ATTR_TTL: Duration = Duration::from_secs(1);
/// Largest single FUSE write the kernel is told to send.
const MAX_WRITE_BYTES: u32 = 1 << 20;
const BLOCK_BYTES: u32 = 4096;

/// Why a mount, attach or detach step failed.
#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    #[error("FUSE mount at {path} failed: {source} (needs /dev/fuse, and root or fusermount3)")]
    Mount {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("FUSE unmount of {path} failed: {reason}")]
    Unmount { path: PathBuf, reason: String },
    #[error("`{command}` failed: {reason}")]
    Command { command: String, reason: String },
    #[error("{0}")]
    Setup(String),
}

// ---- The file system -------------------------------------------------------------------------

/// Settings of a FUSE mount.
#[derive(Debug, Clone)]
pub struct MountConfig {
    /// Name of the one file in the root directory.
    pub file_name: String,
    /// The (multi-threaded) runtime that runs the device's futures.
    pub runtime: Handle,
    /// I/Os (read, write, flush, fallocate) handed to the device at once; the FUSE session
    /// thread waits for a slot beyond that.
    pub max_in_flight_ios: usize,
}

impl MountConfig {
    pub fn new(file_name: impl Into<String>, runtime: Handle) -> Self {
        MountConfig {
            file_name: file_name.into(),
            runtime,
            max_in_flight_ios: 64,
        }
    }
}

struct OneFileFs<D> {
    dev: Arc<D>,
    runtime: Handle,
    file_name: OsString,
    size_bytes: u64,
    uid: u32,
    gid: u32,
    mounted_at: SystemTime,
    io_slots: Arc<Semaphore>,
}

fn errno_for(err: &DevError) -> Errno {
    match err {
        DevError::OutOfRange(_) => Errno::EINVAL,
        DevError::WriteRefused(_) => Errno::EPERM,
        DevError::NoSpace(_) => Errno::ENOSPC,
        DevError::Io(_) => Errno::EIO,
    }
}

impl<D: BlockDev> OneFileFs<D> {
    fn attr(&self, ino: INodeNo) -> FileAttr {
        let (kind, perm, nlink, size) = if ino == ROOT_INO {
            (FileType::Directory, 0o755, 2, 0)
        } else {
            (FileType::RegularFile, 0o600, 1, self.size_bytes)
        };
        FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: self.mounted_at,
            mtime: self.mounted_at,
            ctime: self.mounted_at,
            crtime: self.mounted_at,
            kind,
            perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: BLOCK_BYTES,
            flags: 0,
        }
    }

    /// Runs one device I/O on the runtime, after waiting (on the session thread) for a slot.
    fn spawn_io<F>(&self, io: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let slot = self
            .runtime
            .block_on(self.io_slots.clone().acquire_owned())
            .expect("never closed");
        self.runtime.spawn(async move {
            io.await;
            drop(slot);
        });
    }

    fn spawn_flush(&self, reply: ReplyEmpty) {
        let dev = self.dev.clone();
        self.spawn_io(async move {
            match dev.flush().await {
                Ok(()) => reply.ok(),
                Err(e) => {
                    warn!("fusefile: flush failed: {e}");
                    reply.error(errno_for(&e))
                }
            }
        });
    }
}

impl<D: BlockDev> Filesystem for OneFileFs<D> {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if let Err(nearest) = config.set_max_write(MAX_WRITE_BYTES) {
            let _ = config.set_max_write(nearest);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent == ROOT_INO && name == self.file_name {
            reply.entry(&ATTR_TTL, &self.attr(FILE_INO), Generation(0));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino == ROOT_INO || ino == FILE_INO {
            reply.attr(&ATTR_TTL, &self.attr(ino));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    /// Only a no-op truncate to the device's own size is allowed (O_TRUNC would destroy data
    /// and a block device cannot grow); mode, owner and time changes are ignored.
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        if ino != ROOT_INO && ino != FILE_INO {
            return reply.error(Errno::ENOENT);
        }
        match size {
            Some(s) if ino != FILE_INO || s != self.size_bytes => reply.error(Errno::EPERM),
            _ => reply.attr(&ATTR_TTL, &self.attr(ino)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino == ROOT_INO {
            return reply.error(Errno::EISDIR);
        }
        if ino != FILE_INO {
            return reply.error(Errno::ENOENT);
        }
        if flags.0 & libc::O_TRUNC != 0 {
            return reply.error(Errno::EPERM);
        }
        // Direct I/O: every read and write reaches the device (no page cache in between), and
        // writes to different ranges may run in parallel.
        reply.opened(
            FileHandle(0),
            FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES,
        );
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != FILE_INO {
            return reply.error(Errno::EISDIR);
        }
        if offset >= self.size_bytes {
            return reply.data(&[]);
        }
        let len = (size as u64).min(self.size_bytes - offset) as u32;
        let dev = self.dev.clone();
        self.spawn_io(async move {
            match dev.read(offset, len).await {
                Ok(data) => reply.data(&data),
                Err(e) => {
                    debug!("fusefile: read {offset}+{len} failed: {e}");
                    reply.error(errno_for(&e))
                }
            }
        });
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if ino != FILE_INO {
            return reply.error(Errno::EISDIR);
        }
        // Like a block device: nothing is written past the end; a write across it is cut short.
        if offset >= self.size_bytes && !data.is_empty() {
            return reply.error(Errno::ENOSPC);
        }
        let len = (data.len() as u64).min(self.size_bytes.saturating_sub(offset)) as usize;
        let data = data[..len].to_vec();
        let dev = self.dev.clone();
        self.spawn_io(async move {
            match dev.write(offset, data).await {
                Ok(()) => reply.written(len as u32),
                Err(e) => {
                    debug!("fusefile: write {offset}+{len} failed: {e}");
                    reply.error(errno_for(&e))
                }
            }
        });
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        self.spawn_flush(reply);
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.spawn_flush(reply);
    }

    /// PUNCH_HOLE → trim, ZERO_RANGE → write-zeroes (both clipped at the end of the file);
    /// plain allocation inside the file is a no-op; anything else is EOPNOTSUPP.
    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if ino != FILE_INO {
            return reply.error(Errno::EISDIR);
        }
        let end = offset.saturating_add(length).min(self.size_bytes);
        let len = end.saturating_sub(offset);
        let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        let zero = libc::FALLOC_FL_ZERO_RANGE;
        let dev = self.dev.clone();
        if mode == punch {
            self.spawn_io(async move {
                reply_empty(
                    reply,
                    if len == 0 {
                        Ok(())
                    } else {
                        dev.trim(offset, len).await
                    },
                )
            });
        } else if mode == zero || mode == zero | libc::FALLOC_FL_KEEP_SIZE {
            if mode & libc::FALLOC_FL_KEEP_SIZE == 0
                && offset.saturating_add(length) > self.size_bytes
            {
                return reply.error(Errno::ENOSPC);
            }
            self.spawn_io(async move {
                reply_empty(
                    reply,
                    if len == 0 {
                        Ok(())
                    } else {
                        dev.write_zeroes(offset, len).await
                    },
                )
            });
        } else if mode == 0 || mode == libc::FALLOC_FL_KEEP_SIZE {
            if mode == 0 && offset.saturating_add(length) > self.size_bytes {
                reply.error(Errno::ENOSPC)
            } else {
                reply.ok()
            }
        } else {
            reply.error(Errno::EOPNOTSUPP)
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != ROOT_INO {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (ROOT_INO, FileType::Directory, OsStr::new(".")),
            (ROOT_INO, FileType::Directory, OsStr::new("..")),
            (FILE_INO, FileType::RegularFile, self.file_name.as_os_str()),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            // The offset given is that of the next entry.
            if reply.add(*ino, (i + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let blocks = self.size_bytes / BLOCK_BYTES as u64;
        reply.statfs(blocks, 0, 0, 2, 0, BLOCK_BYTES, 255, BLOCK_BYTES);
    }
}

fn reply_empty(reply: ReplyEmpty, result: Result<(), DevError>) {
    match result {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno_for(&e)),
    }
}

// ---- Mounting --------------------------------------------------------------------------------

/// A mounted one-file FUSE file system. Dropping it unmounts (lazily) without waiting;
/// [`FuseMount::unmount`] unmounts and waits for the session to end.
pub struct FuseMount {
    session: Option<BackgroundSession>,
    mountpoint: PathBuf,
    file_path: PathBuf,
}

/// Mounts `dev` as `mountpoint/file_name`, driving the device on the current tokio runtime
/// (which must be multi-threaded). `mountpoint` must be an existing directory.
pub fn mount<D: BlockDev>(
    dev: Arc<D>,
    mountpoint: &Path,
    file_name: &str,
) -> Result<FuseMount, FuseError> {
    let runtime = Handle::try_current().map_err(|_| {
        FuseError::Setup(
            "fusefile::mount needs a tokio runtime: call it inside one or use mount_with".into(),
        )
    })?;
    mount_with(dev, mountpoint, MountConfig::new(file_name, runtime))
}

/// Mounts `dev` as `mountpoint/<config.file_name>` (see [`MountConfig`]).
pub fn mount_with<D: BlockDev>(
    dev: Arc<D>,
    mountpoint: &Path,
    config: MountConfig,
) -> Result<FuseMount, FuseError> {
    if config.runtime.runtime_flavor() == RuntimeFlavor::CurrentThread {
        return Err(FuseError::Setup(
            "fusefile needs a multi-threaded tokio runtime: on a current-thread runtime, file I/O on the \
             mount would wait on tasks that cannot run"
                .into(),
        ));
    }
    if config.file_name.is_empty()
        || config.file_name.contains('/')
        || config.file_name == "."
        || config.file_name == ".."
    {
        return Err(FuseError::Setup(format!(
            "invalid file name {:?}: one path component expected",
            config.file_name
        )));
    }
    if !mountpoint.is_dir() {
        return Err(FuseError::Setup(format!(
            "mount point {} is not an existing directory",
            mountpoint.display()
        )));
    }
    let owner = std::fs::metadata("/proc/self")
        .map(|m| (m.uid(), m.gid()))
        .unwrap_or((0, 0));
    let fs = OneFileFs {
        size_bytes: dev.size_bytes(),
        dev,
        runtime: config.runtime,
        file_name: OsString::from(&config.file_name),
        uid: owner.0,
        gid: owner.1,
        mounted_at: SystemTime::now(),
        io_slots: Arc::new(Semaphore::new(config.max_in_flight_ios.max(1))),
    };
    let mut options = Config::default();
    options.mount_options = vec![
        MountOption::FSName("understudy".into()),
        MountOption::Subtype("fusefile".into()),
        MountOption::NoAtime,
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoExec,
    ];
    let session =
        fuser::spawn_mount(fs, mountpoint, &options).map_err(|source| FuseError::Mount {
            path: mountpoint.to_path_buf(),
            source,
        })?;
    Ok(FuseMount {
        session: Some(session),
        mountpoint: mountpoint.to_path_buf(),
        file_path: mountpoint.join(&config.file_name),
    })
}

/// How long [`FuseMount::unmount`] waits for the FUSE session to end.
const UNMOUNT_JOIN_TIMEOUT: Duration = Duration::from_secs(10);

impl FuseMount {
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// The one file: `mountpoint/file_name`.
    pub fn file_path(&self) -> &Path {
        &self.file_path
    }

    /// Unmounts and waits (up to 10 s) for the session to end. The unmount is lazy: if
    /// something still has the file open (a loop device, say) the session lives on until it is
    /// closed, and this returns an error saying so.
    pub fn unmount(mut self) -> Result<(), FuseError> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = done_tx.send(session.umount_and_join());
        });
        match done_rx.recv_timeout(UNMOUNT_JOIN_TIMEOUT) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(FuseError::Unmount { path: self.mountpoint.clone(), reason: e.to_string() }),
            Err(_) => Err(FuseError::Unmount {
                path: self.mountpoint.clone(),
                reason: format!(
                    "session still running {UNMOUNT_JOIN_TIMEOUT:?} after a lazy unmount: something still has {} open \
                     (check `losetup -j` and `fuser -m`)",
                    self.file_path.display()
                ),
            }),
        }
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        // Dropping the session unmounts it; its thread ends when the kernel lets go.
        drop(self.session.take());
    }
}

// ---- Attach: FUSE file → loop device → ext4 → mount -------------------------------------------

/// Settings of [`attach`].
#[derive(Debug, Clone)]
pub struct AttachConfig {
    pub mount: MountConfig,
    /// Run `mkfs.ext4` (tables zeroed up front, no lazy init) on the loop device before mounting it.
    pub mkfs_ext4: bool,
    /// Directory for the FUSE mount. `None`: a fresh private (0700) directory under the
    /// system temp dir, removed by detach.
    pub fuse_dir: Option<PathBuf>,
    /// Time allowed to each external command (losetup, mkfs.ext4, mount, umount).
    pub command_timeout_ms: u64,
}

impl AttachConfig {
    pub fn new(file_name: impl Into<String>, runtime: Handle) -> Self {
        AttachConfig {
            mount: MountConfig::new(file_name, runtime),
            mkfs_ext4: false,
            fuse_dir: None,
            command_timeout_ms: 120_000,
        }
    }
}

/// A device attached as a mounted file system. Take it down with [`Attached::detach`] (or
/// [`detach`]); dropping it tries the same and logs what failed.
pub struct Attached {
    fuse: Option<FuseMount>,
    loop_device: Option<PathBuf>,
    mount_dir: PathBuf,
    mounted: bool,
    created_fuse_dir: Option<PathBuf>,
    command_timeout: Duration,
    /// How long each step of [`attach`] took, in order (`fuse`, `losetup`, `mkfs`, `mount`).
    steps: Vec<(&'static str, Duration)>,
}

/// How long detach waits for the kernel to release a loop device after `losetup -d`.
const LOOP_RELEASE_TIMEOUT: Duration = Duration::from_secs(20);
/// How long detach retries `umount` of a busy file system.
const UMOUNT_BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// FUSE-mounts `dev` in a private directory, attaches the file to a loop device
/// (`losetup --find --show --direct-io=on`), optionally runs `mkfs.ext4`, and mounts the loop
/// device on `mount_dir` (an existing directory). On failure, the steps already done are
/// undone. Needs root.
pub fn attach<D: BlockDev>(
    dev: Arc<D>,
    mount_dir: &Path,
    config: AttachConfig,
) -> Result<Attached, FuseError> {
    if !mount_dir.is_dir() {
        return Err(FuseError::Setup(format!(
            "mount directory {} is not an existing directory",
            mount_dir.display()
        )));
    }
    let mut attached = Attached {
        fuse: None,
        loop_device: None,
        mount_dir: mount_dir.to_path_buf(),
        mounted: false,
        created_fuse_dir: None,
        command_timeout: Duration::from_millis(config.command_timeout_ms),
        steps: Vec::new(),
    };
    let fuse_dir = match config.fuse_dir {
        Some(dir) => dir,
        None => {
            let dir = private_dir()?;
            attached.created_fuse_dir = Some(dir.clone());
            dir
        }
    };
    // On any error below, dropping `attached` undoes what was done.
    let t = Instant::now();
    let fuse = mount_with(dev, &fuse_dir, config.mount)?;
    let file = fuse.file_path().to_path_buf();
    attached.fuse = Some(fuse);
    attached.steps.push(("fuse", t.elapsed()));

    let file_arg = file.to_string_lossy().into_owned();
    let t = Instant::now();
    let out = run_command(
        "losetup",
        &["--find", "--show", "--direct-io=on", &file_arg],
        attached.command_timeout,
    )?;
    let loop_device = PathBuf::from(out.trim());
    if !loop_device.starts_with("/dev") {
        return Err(FuseError::Command {
            command: format!("losetup --find --show --direct-io=on {file_arg}"),
            reason: format!("unexpected output {out:?}"),
        });
    }
    attached.loop_device = Some(loop_device.clone());
    attached.steps.push(("losetup", t.elapsed()));
    let loop_arg = loop_device.to_string_lossy().into_owned();

    if config.mkfs_ext4 {
        // Inode tables and journal are zeroed now rather than by the kernel's ext4lazyinit
        // thread after mount: those background writes would compete with the application's
        // I/O for minutes, and on a primary that a monitor suspects they are writes that make
        // `collapse` keep the primary. The cost is ~1.6% of the volume written once at mkfs.
        let t = Instant::now();
        run_command(
            "mkfs.ext4",
            &["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", &loop_arg],
            attached.command_timeout,
        )?;
        attached.steps.push(("mkfs", t.elapsed()));
    }
    let dir_arg = mount_dir.to_string_lossy().into_owned();
    // After an unclean stop this replays the ext4 journal (reads and writes on the volume).
    let t = Instant::now();
    run_command("mount", &[&loop_arg, &dir_arg], attached.command_timeout)?;
    attached.mounted = true;
    attached.steps.push(("mount", t.elapsed()));
    Ok(attached)
}

/// Takes an [`Attached`] stack down: `umount`, `losetup -d`, FUSE unmount.
pub fn detach(mut attached: Attached) -> Result<(), FuseError> {
    attached.detach()
}

impl Attached {
    /// The loop device, e.g. `/dev/loop3` (while attached).
    pub fn loop_device(&self) -> Option<&Path> {
        self.loop_device.as_deref()
    }

    /// How long each step of [`attach`] took, in order: `fuse`, `losetup`, `mkfs` (with
    /// `mkfs_ext4`), `mount` (which replays the ext4 journal after an unclean stop).
    pub fn step_times(&self) -> &[(&'static str, Duration)] {
        &self.steps
    }

    /// Where the file system is mounted.
    pub fn mount_dir(&self) -> &Path {
        &self.mount_dir
    }

    /// The FUSE file behind the loop device (while attached).
    pub fn backing_file(&self) -> Option<&Path> {
        self.fuse.as_ref().map(|f| f.file_path())
    }

    /// Undoes each step still in place, in reverse order: `umount` (retried while busy),
    /// `losetup -d` (then waits for the kernel to release the file), FUSE unmount, removal
    /// of the private directory. Stops at the first failure, which names the step; calling it
    /// again resumes from there.
    pub fn detach(&mut self) -> Result<(), FuseError> {
        if self.mounted {
            let dir = self.mount_dir.to_string_lossy().into_owned();
            let start = Instant::now();
            loop {
                match run_command("umount", &[&dir], self.command_timeout) {
                    Ok(_) => break,
                    Err(e)
                        if start.elapsed() < UMOUNT_BUSY_TIMEOUT
                            && e.to_string().contains("busy") =>
                    {
                        std::thread::sleep(Duration::from_millis(200))
                    }
                    Err(e) => return Err(e),
                }
            }
            self.mounted = false;
        }
        if let Some(loop_device) = self.loop_device.clone() {
            let loop_arg = loop_device.to_string_lossy().into_owned();
            if loop_backing_file(&loop_device).is_some() {
                run_command("losetup", &["-d", &loop_arg], self.command_timeout)?;
            }
            let start = Instant::now();
            while loop_backing_file(&loop_device).is_some() {
                if start.elapsed() > LOOP_RELEASE_TIMEOUT {
                    return Err(FuseError::Command {
                        command: format!("losetup -d {loop_arg}"),
                        reason: format!(
                            "{loop_arg} still attached after {LOOP_RELEASE_TIMEOUT:?}: something holds it open \
                             (check `lsblk`, `fuser {loop_arg}`)"
                        ),
                    });
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            self.loop_device = None;
        }
        if let Some(fuse) = self.fuse.take() {
            fuse.unmount()?;
        }
        if let Some(dir) = self.created_fuse_dir.take() {
            if let Err(e) = std::fs::remove_dir(&dir) {
                warn!("fusefile: cannot remove {}: {e}", dir.display());
            }
        }
        Ok(())
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        if self.mounted
            || self.loop_device.is_some()
            || self.fuse.is_some()
            || self.created_fuse_dir.is_some()
        {
            if let Err(e) = self.detach() {
                warn!("fusefile: detach on drop failed: {e}");
            }
        }
    }
}

/// The backing file of a loop device per sysfs, or `None` once the device is released.
fn loop_backing_file(loop_device: &Path) -> Option<String> {
    let name = loop_device.file_name()?.to_string_lossy().into_owned();
    let text = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).ok()?;
    Some(text.trim().to_string())
}

fn private_dir() -> Result<PathBuf, FuseError> {
    use std::os::unix::fs::DirBuilderExt;
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("understudy-fusefile-{}-{n}", std::process::id()));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|e| {
            FuseError::Setup(format!(
                "cannot create private directory {}: {e}",
                dir.display()
            ))
        })?;
    Ok(dir)
}

/// Runs a command with a timeout; returns its stdout, or an error with its stderr.
fn run_command(program: &str, args: &[&str], timeout: Duration) -> Result<String, FuseError> {
    let command = format!("{program} {}", args.join(" "));
    let fail = |reason: String| FuseError::Command {
        command: command.clone(),
        reason,
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            fail(format!(
                "cannot start {program} ({e}); is it installed and on PATH?"
            ))
        })?;
    let mut stdout_pipe = child.stdout.take().expect("piped");
    let mut stderr_pipe = child.stderr.take().expect("piped");
    let stdout_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout_pipe.read_to_string(&mut s);
        s
    });
    let stderr_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr_pipe.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() > timeout => {
                let _ = child.kill();
                // Not waited on for ever: a command stuck in the kernel (D state) never dies.
                let grace = Instant::now() + Duration::from_secs(1);
                while matches!(child.try_wait(), Ok(None)) && Instant::now() < grace {
                    std::thread::sleep(Duration::from_millis(10));
                }
                return Err(fail(format!("timed out after {timeout:?}; killed")));
            }
            // Short polls: `mount` and `losetup` sit on a failover's critical path.
            Ok(None) => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => return Err(fail(format!("wait failed: {e}"))),
        }
    };
    let stdout = stdout_reader.join().unwrap_or_default();
    let stderr = stderr_reader.join().unwrap_or_default();
    if status.success() {
        debug!("fusefile: `{command}` ok");
        Ok(stdout)
    } else {
        Err(fail(format!("{status}: {}", stderr.trim())))
    }
}
