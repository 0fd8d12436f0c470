//! Where plots and raw samples go.

use crate::Error;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// The output directory of a benchmark area: `override_dir` (the `--out` option) if given, else
/// `target/bench/<area>/` under the current directory. Creates it.
pub fn out_dir(area: &str, override_dir: Option<PathBuf>) -> Result<PathBuf, Error> {
    let dir = override_dir.unwrap_or_else(|| Path::new("target").join("bench").join(area));
    std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
        path: dir.clone(),
        source,
    })?;
    Ok(dir)
}

/// Writes a CSV file (RFC 4180: fields holding a comma, quote or line break are quoted).
/// Panics if a row's width differs from the header's.
pub fn write_csv(
    path: &Path,
    header: &[&str],
    rows: impl IntoIterator<Item = Vec<String>>,
) -> Result<(), Error> {
    let io_error = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut out = BufWriter::new(File::create(path).map_err(io_error)?);
    write_row(&mut out, header.iter().copied()).map_err(io_error)?;
    for row in rows {
        assert_eq!(
            row.len(),
            header.len(),
            "CSV row {row:?} does not match header {header:?}"
        );
        write_row(&mut out, row.iter().map(String::as_str)).map_err(io_error)?;
    }
    out.flush().map_err(io_error)
}

fn write_row<'a>(
    out: &mut impl Write,
    fields: impl Iterator<Item = &'a str>,
) -> std::io::Result<()> {
    for (i, field) in fields.enumerate() {
        if i > 0 {
            out.write_all(b",")?;
        }
        if field.contains([',', '"', '\n', '\r']) {
            write!(out, "\"{}\"", field.replace('"', "\"\""))?;
        } else {
            out.write_all(field.as_bytes())?;
        }
    }
    out.write_all(b"\n")
}

#[cfg(test)]
pub(crate) fn test_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir()
        .join(format!("understudy-bench-{}", std::process::id()))
        .join(name);
    out_dir("unused", Some(dir)).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn override_dir_is_created_and_csv_is_quoted() {
        let dir = test_dir("csv");
        assert!(dir.is_dir());
        let path = dir.join("samples.csv");
        let rows = [
            vec!["1".to_string(), "plain".to_string()],
            vec!["2".into(), "a,\"b\"".into()],
        ];
        write_csv(&path, &["latency_us", "variant"], rows).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "latency_us,variant\n1,plain\n2,\"a,\"\"b\"\"\"\n");
    }
}
