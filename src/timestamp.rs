//! RFC 3339 text for the microsecond timestamps stored in the database.

use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use crate::rate::Micros;

/// Formats Unix microseconds as RFC 3339 UTC, e.g. `2026-11-30T15:31:41.123456Z`.
/// Values outside the calendar range come back as the raw number, never a panic.
pub fn format_us(us: Micros) -> String {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(us) * 1_000)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_else(|| us.to_string())
}

/// Parses an RFC 3339 timestamp (any offset) into Unix microseconds.
pub fn parse_rfc3339(s: &str) -> Result<Micros, String> {
    let t = OffsetDateTime::parse(s, &Rfc3339)
        .map_err(|e| format!("{s:?} is not an RFC 3339 timestamp: {e}"))?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000).map_err(|_| format!("{s:?} is out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let us = parse_rfc3339("2026-11-30T15:31:41.123456Z").expect("parses");
        assert_eq!(format_us(us), "2026-11-30T15:31:41.123456Z");
        assert_eq!(
            parse_rfc3339("2026-11-30T16:31:41.123456+01:00").expect("parses"),
            us
        );
        assert!(parse_rfc3339("yesterday").is_err());
        assert_eq!(format_us(i64::MAX), i64::MAX.to_string());
    }
}
