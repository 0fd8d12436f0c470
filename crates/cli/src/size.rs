//! Human sizes: `512`, `4K`, `64KiB`, `1G`, `1.5T` in, `64 KiB`, `1 GiB` out. Units are binary
//! (K = 1024), as in qemu-img; `B`, `iB` suffixes and lower case are accepted.

const UNITS: [(&str, u32); 6] = [("", 0), ("K", 10), ("M", 20), ("G", 30), ("T", 40), ("P", 50)];

/// Parses a human size into bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let s = text.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let unit = unit.trim();
    let bad = || format!("{text:?} is not a size: write a number with an optional unit, e.g. 512, 64K, 1G, 1.5T");
    if number.is_empty() {
        return Err(bad());
    }
    let unit_upper = unit.to_ascii_uppercase();
    let unit_core = unit_upper.strip_suffix("IB").or_else(|| unit_upper.strip_suffix('B')).unwrap_or(&unit_upper);
    let shift = UNITS.iter().find(|(u, _)| *u == unit_core).map(|(_, s)| *s).ok_or_else(bad)?;
    let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
    if frac_part.contains('.') || (int_part.is_empty() && frac_part.is_empty()) {
        return Err(bad());
    }
    let too_big = || format!("{text:?} is too large");
    let int: u64 = if int_part.is_empty() { 0 } else { int_part.parse().map_err(|_| too_big())? };
    let mut bytes = int.checked_mul(1u64 << shift).ok_or_else(too_big)?;
    if !frac_part.is_empty() {
        // Fraction of the unit, exactly: digits / 10^len * 2^shift, rounded down.
        if frac_part.len() > 9 {
            return Err(format!("{text:?}: at most 9 decimal places"));
        }
        let digits: u128 = frac_part.parse().map_err(|_| bad())?;
        let frac_bytes = (digits << shift) / 10u128.pow(frac_part.len() as u32);
        if !(digits << shift).is_multiple_of(10u128.pow(frac_part.len() as u32)) {
            return Err(format!("{text:?} is not a whole number of bytes"));
        }
        bytes = bytes.checked_add(frac_bytes as u64).ok_or_else(too_big)?;
    }
    Ok(bytes)
}

/// Formats bytes with the largest binary unit that keeps a short number: `64 KiB`, `1.5 GiB`.
pub fn format_size(bytes: u64) -> String {
    let (name, shift) =
        [("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)].into_iter().find(|(_, s)| bytes >= 1u64 << s).unwrap_or(("B", 0));
    if shift == 0 {
        return format!("{bytes} B");
    }
    let v = bytes as f64 / (1u64 << shift) as f64;
    if bytes.is_multiple_of(1u64 << shift) {
        format!("{} {name}", bytes >> shift)
    } else {
        format!("{v:.1} {name}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("512").unwrap(), 512);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("64kb").unwrap(), 65536);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size(" 2 MiB ").unwrap(), 2 << 20);
        assert_eq!(parse_size("1P").unwrap(), 1 << 50);
        assert_eq!(parse_size("0.5K").unwrap(), 512);
    }

    #[test]
    fn rejects_nonsense() {
        for s in ["", "G", "1X", "1..5G", "-1", "1.2.3", "99999999999999999999", "20000P", "0.0001K"] {
            assert!(parse_size(s).is_err(), "{s:?} parsed");
        }
    }

    #[test]
    fn formats() {
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(65536), "64 KiB");
        assert_eq!(format_size(1 << 30), "1 GiB");
        assert_eq!(format_size(3 << 29), "1.5 GiB");
    }
}
