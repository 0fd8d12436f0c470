//! Settings: the environment's configuration, the path patterns and path normalisation.

use super::*;

pub(super) struct Config {
    pub(super) controller: String,
    pub(super) secret: Vec<u8>,
    pub(super) deadline: Duration,
    /// How long a call polls for replies without sleeping (see [`Shim::wait_replies`]).
    pub(super) spin: Duration,
    /// Longest a batch is held back from the peers beyond a majority ([`Shim::pump`]):
    /// `UNDERSTUDY_NEARLOG_DEFER_US`, default [`DEFAULT_DEFER_US`].
    pub(super) defer: Duration,
}

/// Default of `UNDERSTUDY_NEARLOG_SPIN_US`: a majority's replies on loopback or a LAN take
/// tens of µs; longer waits (a slow or dead peer) block in `poll` after this.
pub(super) const DEFAULT_SPIN_US: u64 = 50;

pub(super) fn load_config() -> Result<Config, String> {
    let deadline_ms = match std::env::var("UNDERSTUDY_NEARLOG_DEADLINE_MS") {
        Ok(s) => s.parse::<u64>().map_err(|_| format!("UNDERSTUDY_NEARLOG_DEADLINE_MS={s:?} is not a number of milliseconds"))?,
        Err(_) => 10_000,
    };
    let cluster = std::env::var("UNDERSTUDY_NEARLOG_CLUSTER").map_err(|_| "UNDERSTUDY_NEARLOG_CLUSTER is not set (the nearlog-cluster.json of `understudy nearlog up`)".to_string())?;
    let text = std::fs::read(&cluster).map_err(|e| format!("cannot read {cluster}: {e}"))?;
    let v: serde_json::Value = serde_json::from_slice(&text).map_err(|e| format!("{cluster} is not JSON: {e}"))?;
    let controller = v["controller"].as_str().ok_or(format!("{cluster} has no \"controller\""))?.to_string();
    let secret_file = v["secret_file"].as_str().ok_or(format!("{cluster} has no \"secret_file\""))?;
    let secret = std::fs::read(secret_file).map_err(|e| format!("cannot read the cluster secret {secret_file}: {e}"))?.trim_ascii().to_vec();
    if secret.is_empty() {
        return Err(format!("cluster secret {secret_file} is empty"));
    }
    // A bad link TLS setting (UNDERSTUDY_LINK_TLS*) stops here with its reason, before any
    // connection; the certificate files are read once, at this first use.
    blocking::link_tls().map_err(|e| e.to_string())?;
    let spin_us = match std::env::var("UNDERSTUDY_NEARLOG_SPIN_US") {
        Ok(s) => s.parse::<u64>().ok().filter(|&us| us <= 10_000).ok_or_else(|| format!("UNDERSTUDY_NEARLOG_SPIN_US={s:?} is not a number of microseconds up to 10000"))?,
        Err(_) => DEFAULT_SPIN_US,
    };
    let defer_us = match std::env::var("UNDERSTUDY_NEARLOG_DEFER_US") {
        Ok(s) => s.parse::<u64>().ok().filter(|&us| us <= MAX_DEFER_US).ok_or_else(|| format!("UNDERSTUDY_NEARLOG_DEFER_US={s:?} is not a number of microseconds up to {MAX_DEFER_US}"))?,
        Err(_) => DEFAULT_DEFER_US,
    };
    Ok(Config { controller, secret, deadline: Duration::from_millis(deadline_ms), spin: Duration::from_micros(spin_us), defer: Duration::from_micros(defer_us) })
}

/// `*` matches any run of characters (including `/`), `?` one character.
pub fn glob_match(pat: &str, s: &str) -> bool {
    let (p, s) = (pat.as_bytes(), s.as_bytes());
    let (mut pi, mut si, mut star, mut mark) = (0, 0, None, 0);
    while si < s.len() {
        if pi < p.len() && (p[pi] == b'?' || p[pi] == s[si]) {
            pi += 1;
            si += 1;
        } else if pi < p.len() && p[pi] == b'*' {
            star = Some(pi);
            pi += 1;
            mark = si;
        } else if let Some(sp) = star {
            pi = sp + 1;
            mark += 1;
            si = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

/// Config errors are reported once per process, then every log open fails.
pub(super) static PATTERNS: OnceLock<Vec<String>> = OnceLock::new();

pub(super) fn patterns() -> &'static [String] {
    PATTERNS.get_or_init(|| std::env::var("UNDERSTUDY_NEARLOG_PATTERNS").unwrap_or_default().split(':').filter(|p| !p.is_empty()).map(String::from).collect())
}

/// The absolute path of `path` relative to `dirfd` (lexically; the file may not exist yet).
pub(super) unsafe fn absolute(dirfd: c_int, path: &CStr) -> Option<String> {
    let p = path.to_str().ok()?;
    if p.starts_with('/') {
        return Some(normalize(p));
    }
    let base = if dirfd == libc::AT_FDCWD {
        std::env::current_dir().ok()?.to_str()?.to_string()
    } else {
        std::fs::read_link(format!("/proc/self/fd/{dirfd}")).ok()?.to_str()?.to_string()
    };
    Some(normalize(&format!("{base}/{p}")))
}

pub(super) fn normalize(p: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    format!("/{}", out.join("/"))
}

/// Whether `path` (relative to the working directory) names a log file by the patterns.
pub unsafe fn is_log_stream_path(path: *const c_char) -> bool {
    if path.is_null() || patterns().is_empty() {
        return false;
    }
    let Some(_g) = Guard::enter() else { return false };
    absolute(libc::AT_FDCWD, CStr::from_ptr(path)).is_some_and(|abs| is_log_path(&abs))
}

/// Whether `fd` is a replicated log fd.
pub fn is_log_fd(fd: c_int) -> bool {
    is_tracked(fd) && IN_SHIM.with(|g| !g.get())
}

pub(super) fn is_log_path(abs: &str) -> bool {
    patterns().iter().any(|p| glob_match(p, abs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("*-wal", "/x/db.sqlite-wal"));
        assert!(glob_match("*.aof*", "/d/appendonly.aof.1.incr.aof"));
        assert!(!glob_match("*.log", "/d/x.logs"));
        assert!(glob_match("/d/?.log", "/d/a.log"));
        assert_eq!(normalize("/a/./b/../c//d"), "/a/c/d");
    }
}
