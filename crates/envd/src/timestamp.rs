//! `google.protobuf.Timestamp`, which proto3 JSON writes as an RFC 3339 string in UTC.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// A point in time: seconds and nanoseconds since the Unix epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp {
    /// Whole seconds since 1970-01-01T00:00:00Z (negative before it).
    pub seconds: i64,
    /// Nanoseconds within the second, always in `0..1_000_000_000`.
    pub nanos: i32,
}

/// Why an RFC 3339 string could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid RFC 3339 timestamp {0:?}")]
pub struct TimestampError(pub String);

impl Timestamp {
    /// The timestamp of a [`SystemTime`].
    pub fn from_system_time(t: SystemTime) -> Self {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Self { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32 },
            Err(e) => {
                let d = e.duration();
                let (mut s, mut n) = (-(d.as_secs() as i64), -(d.subsec_nanos() as i32));
                if n < 0 {
                    s -= 1;
                    n += 1_000_000_000;
                }
                Self { seconds: s, nanos: n }
            }
        }
    }

    /// This timestamp as a [`SystemTime`].
    pub fn to_system_time(self) -> SystemTime {
        let nanos = Duration::from_nanos(self.nanos.clamp(0, 999_999_999) as u64);
        if self.seconds >= 0 {
            UNIX_EPOCH + Duration::from_secs(self.seconds as u64) + nanos
        } else {
            UNIX_EPOCH - Duration::from_secs(self.seconds.unsigned_abs()) + nanos
        }
    }

    /// Formats as RFC 3339 in UTC with 0, 3, 6 or 9 fraction digits, like protobuf encoders.
    pub fn to_rfc3339(self) -> String {
        let days = self.seconds.div_euclid(86_400);
        let secs = self.seconds.rem_euclid(86_400);
        let (y, m, d) = civil_from_days(days);
        let mut out = format!(
            "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
            secs / 3600,
            secs / 60 % 60,
            secs % 60
        );
        let n = self.nanos.clamp(0, 999_999_999);
        if n != 0 {
            if n % 1_000_000 == 0 {
                out.push_str(&format!(".{:03}", n / 1_000_000));
            } else if n % 1_000 == 0 {
                out.push_str(&format!(".{:06}", n / 1_000));
            } else {
                out.push_str(&format!(".{n:09}"));
            }
        }
        out.push('Z');
        out
    }

    /// Parses `YYYY-MM-DDTHH:MM:SS[.fraction](Z|±HH:MM)`.
    pub fn parse_rfc3339(s: &str) -> Result<Self, TimestampError> {
        let err = || TimestampError(s.to_string());
        let b = s.as_bytes();
        if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
            return Err(err());
        }
        if b[13] != b':' || b[16] != b':' {
            return Err(err());
        }
        let num = |r: std::ops::Range<usize>| -> Result<i64, TimestampError> {
            let part = s.get(r).ok_or_else(err)?;
            if !part.bytes().all(|c| c.is_ascii_digit()) {
                return Err(err());
            }
            part.parse::<i64>().map_err(|_| err())
        };
        let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
        let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
        if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
            return Err(err());
        }
        let mut i = 19;
        let mut nanos: i64 = 0;
        if b.get(i) == Some(&b'.') {
            i += 1;
            let start = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            let digits = &s[start..i];
            if digits.is_empty() || digits.len() > 9 {
                return Err(err());
            }
            nanos = digits.parse::<i64>().map_err(|_| err())? * 10i64.pow(9 - digits.len() as u32);
        }
        let offset = match b.get(i) {
            Some(b'Z' | b'z') if i + 1 == b.len() => 0,
            Some(sign @ (b'+' | b'-')) if i + 6 == b.len() && b[i + 3] == b':' => {
                let off = num(i + 1..i + 3)? * 3600 + num(i + 4..i + 6)? * 60;
                if *sign == b'+' {
                    off
                } else {
                    -off
                }
            }
            _ => return Err(err()),
        };
        let days = days_from_civil(y, mo as u32, d as u32);
        let seconds = days * 86_400 + h * 3600 + mi * 60 + sec - offset;
        Ok(Self { seconds, nanos: nanos as i32 })
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_rfc3339())
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_rfc3339())
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Timestamp;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an RFC 3339 timestamp string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Timestamp, E> {
                Timestamp::parse_rfc3339(v).map_err(E::custom)
            }
        }
        d.deserialize_str(V)
    }
}

// Proleptic Gregorian calendar conversions (H. Hinnant's algorithms).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_like_protobuf() {
        assert_eq!(Timestamp { seconds: 0, nanos: 0 }.to_rfc3339(), "1970-01-01T00:00:00Z");
        assert_eq!(
            Timestamp { seconds: 1_700_000_000, nanos: 120_000_000 }.to_rfc3339(),
            "2023-11-14T22:13:20.120Z"
        );
        assert_eq!(
            Timestamp { seconds: 951_782_400, nanos: 1 }.to_rfc3339(),
            "2000-02-29T00:00:00.000000001Z"
        );
        assert_eq!(Timestamp { seconds: -1, nanos: 0 }.to_rfc3339(), "1969-12-31T23:59:59Z");
    }

    #[test]
    fn parses_offsets_and_fractions() {
        let t = Timestamp::parse_rfc3339("2023-11-14T22:13:20.12Z").unwrap();
        assert_eq!(t, Timestamp { seconds: 1_700_000_000, nanos: 120_000_000 });
        let t = Timestamp::parse_rfc3339("2023-11-15T00:13:20+02:00").unwrap();
        assert_eq!(t.seconds, 1_700_000_000);
        assert!(Timestamp::parse_rfc3339("2023-11-15").is_err());
        assert!(Timestamp::parse_rfc3339("2023-13-15T00:13:20Z").is_err());
        assert!(Timestamp::parse_rfc3339("2023-11-15T00:13:20.Z").is_err());
    }

    #[test]
    fn round_trips_system_time() {
        let now = SystemTime::now();
        let t = Timestamp::from_system_time(now);
        assert_eq!(t.to_system_time(), now);
        assert_eq!(Timestamp::parse_rfc3339(&t.to_rfc3339()).unwrap(), t);
    }
}
