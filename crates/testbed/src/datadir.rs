//! What the database drivers (`failover postgres`, `failover mariadb`) share about their data
//! directory on an instance's volume: the unprivileged user the server runs as, a check that
//! it can reach the directory, and making a fresh database in a scratch directory that is
//! renamed into place (a crash while it is made leaves nothing half made).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::Context;

/// uid and gid of user `name`.
pub fn lookup_user(name: &str) -> anyhow::Result<(u32, u32)> {
    let c = std::ffi::CString::new(name)?;
    // SAFETY: getpwnam reads a NUL-terminated string and returns a pointer to static storage (or
    // null), which is read at once, before any other call that could overwrite it.
    let pw = unsafe { libc::getpwnam(c.as_ptr()) };
    anyhow::ensure!(!pw.is_null(), "no user {name:?} on this machine");
    // SAFETY: checked non-null above; the fields are plain integers.
    Ok(unsafe { ((*pw).pw_uid, (*pw).pw_gid) })
}

/// The data directory (absolute) and its parent, once every directory above it is searchable
/// by `user` (`uid`, `gid`): the server runs as that user and must reach its data.
pub fn reachable_by(data: &Path, user: &str, uid: u32, gid: u32) -> anyhow::Result<(PathBuf, PathBuf)> {
    let data = std::path::absolute(data)?;
    let parent = data.parent().context("--data has no parent directory")?.to_path_buf();
    for dir in parent.ancestors() {
        let m = std::fs::metadata(dir).with_context(|| format!("{}", dir.display()))?;
        let ok = m.mode() & 0o001 != 0 || (m.uid() == uid && m.mode() & 0o100 != 0) || (m.gid() == gid && m.mode() & 0o010 != 0);
        anyhow::ensure!(ok, "user {user} cannot reach {}: {} is not searchable by it (chmod o+x)", data.display(), dir.display());
    }
    Ok((data, parent))
}

/// Makes a fresh database at `data` (absolute; `parent` its parent) with `make(scratch)`, in
/// a scratch directory `.NAME.SUFFIX` beside it that `uid`/`gid` own (mode `mode`), renamed
/// into place and made durable once `make` succeeded. `data` must be missing or empty; `what`
/// names the database in the error otherwise.
pub fn make_in_scratch(
    data: &Path,
    parent: &Path,
    suffix: &str,
    what: &str,
    (uid, gid): (u32, u32),
    mode: Option<u32>,
    make: impl FnOnce(&Path) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    anyhow::ensure!(!data.exists() || std::fs::read_dir(data)?.next().is_none(), "{} exists and holds no {what}", data.display());
    let name = data.file_name().context("--data names no directory")?.to_string_lossy();
    let scratch = parent.join(format!(".{name}.{suffix}"));
    if scratch.exists() {
        std::fs::remove_dir_all(&scratch)?;
    }
    std::fs::create_dir_all(&scratch)?;
    if let Some(m) = mode {
        std::fs::set_permissions(&scratch, std::fs::Permissions::from_mode(m))?;
    }
    std::os::unix::fs::chown(&scratch, Some(uid), Some(gid))?;
    make(&scratch)?;
    if data.exists() {
        std::fs::remove_dir(data)?;
    }
    std::fs::rename(&scratch, data)?;
    std::fs::File::open(parent)?.sync_all()?;
    Ok(())
}
