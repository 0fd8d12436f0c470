//! fio's JSON output, read in one place for every experiment that runs fio (the volume cow
//! experiment's NBD-against-local-file figures, the Ceph comparison).

use anyhow::{ensure, Context};

/// fio's JSON document; fio may print notes before it, which are skipped.
pub fn document(stdout: &[u8]) -> anyhow::Result<serde_json::Value> {
    let text = String::from_utf8_lossy(stdout);
    let start = text.find('{').context("fio printed no JSON")?;
    serde_json::from_str(&text[start..]).context("fio's JSON output")
}

/// What one fio job measured for its writes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FioWrites {
    pub ios: u64,
    pub runtime_ms: u64,
    pub lat_mean_us: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
}

/// The first job's write count, run time and total (submission to completion) latency, from
/// `--output-format=json --lat_percentiles=1` output.
pub fn first_job_writes(stdout: &[u8]) -> anyhow::Result<FioWrites> {
    let v = document(stdout)?;
    let w = &v["jobs"][0]["write"];
    let ios = w["total_ios"].as_u64().context("fio's JSON has no write.total_ios")?;
    ensure!(ios > 0, "fio measured no writes");
    let lat = &w["lat_ns"];
    let pct = |p: &str| lat["percentile"][p].as_f64().map(|ns| ns / 1e3).with_context(|| format!("fio's JSON has no write.lat_ns percentile {p}"));
    Ok(FioWrites {
        ios,
        runtime_ms: w["runtime"].as_u64().context("fio's JSON has no write.runtime")?.max(1),
        lat_mean_us: lat["mean"].as_f64().context("fio's JSON has no write.lat_ns.mean")? / 1e3,
        lat_p50_us: pct("50.000000")?,
        lat_p99_us: pct("99.000000")?,
    })
}

/// The write IOPS of all jobs together, from `--output-format=json` output.
pub fn write_iops(stdout: &[u8]) -> anyhow::Result<f64> {
    let v = document(stdout)?;
    let jobs = v["jobs"].as_array().context("fio's JSON has no jobs")?;
    let iops: f64 = jobs.iter().filter_map(|j| j["write"]["iops"].as_f64()).sum();
    ensure!(iops > 0.0, "fio measured no writes");
    Ok(iops)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fio_json_is_parsed_after_notes() {
        let out = b"note: something\n{\"jobs\": [{\"write\": {\"iops\": 1200.5}}, {\"write\": {\"iops\": 10}}]}";
        assert_eq!(write_iops(out).unwrap(), 1210.5);
        assert!(write_iops(b"{\"jobs\": [{\"write\": {\"iops\": 0}}]}").is_err());
        assert!(write_iops(b"garbage").is_err());
    }
}
