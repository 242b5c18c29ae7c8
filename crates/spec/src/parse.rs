//! Human-friendly sizes and durations, as typed on a command line or sent in a request.

use crate::SpecError;
use std::time::Duration;

/// Parses `512M`, `1G`, `64MiB`, `1.5g`, `4096` (bytes). Binary units: K = 1024.
pub fn parse_size(s: &str) -> Result<u64, SpecError> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || {
        SpecError::new(
            "size",
            format!("'{s}' is not a size: use a number with an optional unit K, M, G or T (e.g. 512M, 1G)"),
        )
    };
    if num.is_empty() {
        return Err(bad());
    }
    let value: f64 = num.parse().map_err(|_| bad())?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(bad()),
    };
    let bytes = value * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 / 2.0 {
        return Err(bad());
    }
    Ok(bytes.round() as u64)
}

/// Parses `300s`, `2s`, `1.5s`, `500ms`, `5m`, `1h`, `30d`, or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, SpecError> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || {
        SpecError::new("duration", format!("'{s}' is not a duration: use e.g. 300s, 500ms, 5m, 1h or 30d"))
    };
    if num.is_empty() {
        return Err(bad());
    }
    let value: f64 = num.parse().map_err(|_| bad())?;
    let secs = match unit.trim() {
        "" | "s" | "sec" => value,
        "ms" => value / 1000.0,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        "d" => value * 86400.0,
        _ => return Err(bad()),
    };
    if !secs.is_finite() || !(0.0..=1e9).contains(&secs) {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(secs))
}

/// `536870912` -> `512 MiB`, for messages.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if v.fract() == 0.0 {
        format!("{} {}", v as u64, UNITS[i])
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("64m").unwrap(), 64 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1.5k").unwrap(), 1536);
    }

    #[test]
    fn bad_sizes_say_what_to_do() {
        for bad in ["12XB", "", "M", "-1G", "1..2M", "1e9"] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.to_string().contains("512M"), "{bad}: {e}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("300s").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert!(parse_duration("soon").is_err());
        assert_eq!(parse_duration("30d").unwrap(), Duration::from_secs(30 * 86400));
        assert!(parse_duration("5w").is_err());
    }

    #[test]
    fn formatting() {
        assert_eq!(format_size(512 << 20), "512 MiB");
        assert_eq!(format_size(64 << 20), "64 MiB");
        assert_eq!(format_size(1 << 30), "1 GiB");
        assert_eq!(format_size(1000), "1000 B");
    }
}
