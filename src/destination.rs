//! Destinations: a downstream with its own limit, and the settings that shape its traffic.
//!
//! [`DestinationConfig`] is what users write, in `config.toml` or in a `PUT
//! /v1/destinations/{name}` body; [`DestinationConfig::validate`] turns it into a
//! [`DestinationSpec`] the store can persist, naming the bad field and value on error.

use std::fmt;

use reqwest::Url;
use serde::{Deserialize, Serialize};

use crate::rate::{Gcra, Rate};
use crate::throttle::{ResetUnit, ThrottlePolicy};

/// A destination name: `[A-Za-z0-9._:-]{1,128}` (DESIGN vocabulary).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct DestinationName(String);

/// Why a destination name was refused.
#[derive(Debug, Clone, thiserror::Error)]
#[error("invalid destination name {0:?}: use 1 to 128 characters from A-Z a-z 0-9 . _ : -")]
pub struct InvalidName(pub String);

impl DestinationName {
    /// Validates a name.
    pub fn parse(name: &str) -> Result<Self, InvalidName> {
        let ok = !name.is_empty()
            && name.len() <= 128
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'));
        if ok {
            Ok(Self(name.to_owned()))
        } else {
            Err(InvalidName(name.to_owned()))
        }
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for DestinationName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for DestinationName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Defaults for optional destination settings. Public so docs and config agree.
pub mod defaults {
    /// One release at a time: a pure leaky bucket.
    pub const BURST: u32 = 1;
    /// Per-request timeout.
    pub const TIMEOUT_MS: u64 = 10_000;
    /// Attempts before a job is dead-lettered.
    pub const MAX_ATTEMPTS: u32 = 10;
    /// First retry waits up to this long (full jitter).
    pub const BACKOFF_BASE_MS: u64 = 1_000;
    /// Retries never wait longer than this.
    pub const BACKOFF_CAP_MS: u64 = 300_000;
    /// Longest downstream wait hint honoured (longer ones are clamped).
    pub const RETRY_AFTER_MAX_MS: u64 = 3_600_000;
    /// Least wait after a 429, whatever the hint.
    pub const THROTTLE_FLOOR_MS: u64 = 1_000;
    /// First wait after a 429 without a hint; doubles per consecutive 429.
    pub const THROTTLE_BACKOFF_BASE_MS: u64 = 1_000;
    /// Cap of the no-hint 429 backoff.
    pub const THROTTLE_BACKOFF_CAP_MS: u64 = 300_000;
    /// Throttles one job may take before it is dead-lettered.
    pub const MAX_THROTTLES: u32 = 100;
}

/// A destination as a user writes it. Only `rate` and `capacity` are required.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DestinationConfig {
    /// Sustained limit, e.g. `50/s`.
    pub rate: Rate,
    /// Admitted-but-unfinished jobs allowed at once; enqueues beyond it get 429.
    pub capacity: u64,
    /// Releases allowed back to back after idleness (default 1: strict spacing).
    #[serde(default)]
    pub burst: Option<u32>,
    /// Cap on concurrent requests to this destination (default: none).
    #[serde(default)]
    pub max_in_flight: Option<u32>,
    /// URLs jobs may target; empty means any http(s) URL.
    #[serde(default)]
    pub allowed_base_urls: Vec<String>,
    /// Per-request timeout in milliseconds.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Attempts before a job is dead-lettered (jobs may ask for fewer or more).
    #[serde(default)]
    pub max_attempts: Option<u32>,
    /// Base of the exponential retry backoff, in milliseconds.
    #[serde(default)]
    pub backoff_base_ms: Option<u64>,
    /// Cap of the exponential retry backoff, in milliseconds.
    #[serde(default)]
    pub backoff_cap_ms: Option<u64>,
    /// Longest downstream wait hint honoured, in milliseconds.
    #[serde(default)]
    pub retry_after_max_ms: Option<u64>,
    /// Least wait after a 429, in milliseconds.
    #[serde(default)]
    pub throttle_floor_ms: Option<u64>,
    /// First wait after a 429 without a hint; doubles per consecutive 429.
    #[serde(default)]
    pub throttle_backoff_base_ms: Option<u64>,
    /// Cap of the no-hint 429 backoff.
    #[serde(default)]
    pub throttle_backoff_cap_ms: Option<u64>,
    /// Throttles a job may take before it is dead-lettered.
    #[serde(default)]
    pub max_throttles: Option<u32>,
    /// How to read `X-RateLimit-Reset`: `"delta"` or `"epoch"` seconds; unset ignores
    /// the X-RateLimit headers.
    #[serde(default)]
    pub ratelimit_reset: Option<ResetUnit>,
    /// Lower the rate on repeated 429s and recover it on success (off by default).
    #[serde(default)]
    pub adaptive_rate: Option<bool>,
    /// Whether the dispatcher holds this destination's jobs. `None` keeps the current
    /// value on update (and means "not paused" on create).
    #[serde(default)]
    pub paused: Option<bool>,
}

/// A validation failure, naming the field and the offending value.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    /// The field, e.g. `capacity` or `allowed_base_urls[1]`.
    pub field: String,
    /// What is wrong with its value.
    pub message: String,
}

impl FieldError {
    fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// A validated destination, ready to persist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DestinationSpec {
    /// Sustained limit.
    pub rate: Rate,
    /// Releases back to back after idleness.
    pub burst: u32,
    /// Bound on admitted-but-unfinished jobs.
    pub capacity: i64,
    /// Optional cap on concurrent requests.
    pub max_in_flight: Option<i32>,
    /// Allowed URL prefixes, normalised.
    pub allowed_base_urls: Vec<String>,
    /// Per-request timeout.
    pub timeout_ms: i32,
    /// Default attempts per job.
    pub max_attempts: i32,
    /// Retry backoff base.
    pub backoff_base_ms: i64,
    /// Retry backoff cap.
    pub backoff_cap_ms: i64,
    /// How throttling signals are read.
    pub throttle: ThrottlePolicy,
    /// No-hint 429 backoff base.
    pub throttle_backoff_base_ms: i64,
    /// No-hint 429 backoff cap.
    pub throttle_backoff_cap_ms: i64,
    /// Throttles per job before it is dead.
    pub max_throttles: i32,
    /// Adaptive rate on or off.
    pub adaptive_rate: bool,
    /// `Some` to set the paused flag, `None` to keep it.
    pub paused: Option<bool>,
}

impl DestinationSpec {
    /// The slot arithmetic for this destination.
    pub fn gcra(&self) -> Gcra {
        Gcra {
            interval_us: self.rate.interval_us(),
            burst: self.burst,
        }
    }
}

/// Largest capacity accepted: a backlog bigger than this is a misconfiguration.
pub const MAX_CAPACITY: u64 = 100_000_000;

impl DestinationConfig {
    /// Checks every field and fills in defaults.
    pub fn validate(&self) -> Result<DestinationSpec, FieldError> {
        let burst = self.burst.unwrap_or(defaults::BURST);
        if !(1..=100_000).contains(&burst) {
            return Err(FieldError::new(
                "burst",
                format!("{burst} is out of range (1 to 100000)"),
            ));
        }
        if !(1..=MAX_CAPACITY).contains(&self.capacity) {
            return Err(FieldError::new(
                "capacity",
                format!("{} is out of range (1 to {MAX_CAPACITY})", self.capacity),
            ));
        }
        let max_in_flight = match self.max_in_flight {
            None => None,
            Some(n @ 1..=100_000) => Some(n as i32),
            Some(n) => {
                return Err(FieldError::new(
                    "max_in_flight",
                    format!("{n} is out of range (1 to 100000)"),
                ))
            }
        };
        let timeout_ms = self.timeout_ms.unwrap_or(defaults::TIMEOUT_MS);
        if !(1..=600_000).contains(&timeout_ms) {
            return Err(FieldError::new(
                "timeout_ms",
                format!("{timeout_ms} is out of range (1 to 600000)"),
            ));
        }
        let max_attempts = self.max_attempts.unwrap_or(defaults::MAX_ATTEMPTS);
        check_attempts("max_attempts", max_attempts)?;
        let base = self.backoff_base_ms.unwrap_or(defaults::BACKOFF_BASE_MS);
        let cap = self.backoff_cap_ms.unwrap_or(defaults::BACKOFF_CAP_MS);
        if !(1..=86_400_000).contains(&base) {
            return Err(FieldError::new(
                "backoff_base_ms",
                format!("{base} is out of range (1 to 86400000)"),
            ));
        }
        if !(base..=86_400_000).contains(&cap) {
            return Err(FieldError::new(
                "backoff_cap_ms",
                format!("{cap} is out of range (backoff_base_ms {base} to 86400000)"),
            ));
        }
        if burst > 1
            && self.rate.interval_us().saturating_mul(i64::from(burst - 1))
                > crate::rate::MAX_INTERVAL_US
        {
            return Err(FieldError::new(
                "burst",
                format!("{burst} bursts at {} span more than 31 years", self.rate),
            ));
        }
        let retry_after_max = self
            .retry_after_max_ms
            .unwrap_or(defaults::RETRY_AFTER_MAX_MS);
        ms_range("retry_after_max_ms", retry_after_max, 1_000, 7 * 86_400_000)?;
        let floor = self
            .throttle_floor_ms
            .unwrap_or(defaults::THROTTLE_FLOOR_MS);
        ms_range("throttle_floor_ms", floor, 0, retry_after_max)?;
        let tb_base = self
            .throttle_backoff_base_ms
            .unwrap_or(defaults::THROTTLE_BACKOFF_BASE_MS);
        ms_range("throttle_backoff_base_ms", tb_base, 1, 86_400_000)?;
        let tb_cap = self
            .throttle_backoff_cap_ms
            .unwrap_or(defaults::THROTTLE_BACKOFF_CAP_MS.max(tb_base));
        ms_range("throttle_backoff_cap_ms", tb_cap, tb_base, 86_400_000)?;
        let max_throttles = self.max_throttles.unwrap_or(defaults::MAX_THROTTLES);
        if !(1..=100_000).contains(&max_throttles) {
            return Err(FieldError::new(
                "max_throttles",
                format!("{max_throttles} is out of range (1 to 100000)"),
            ));
        }
        let mut allowed = Vec::with_capacity(self.allowed_base_urls.len());
        for (i, raw) in self.allowed_base_urls.iter().enumerate() {
            let base = parse_base_url(raw)
                .map_err(|m| FieldError::new(format!("allowed_base_urls[{i}]"), m))?;
            allowed.push(base.to_string());
        }
        Ok(DestinationSpec {
            rate: self.rate.clone(),
            burst,
            capacity: self.capacity as i64,
            max_in_flight,
            allowed_base_urls: allowed,
            timeout_ms: timeout_ms as i32,
            max_attempts: max_attempts as i32,
            backoff_base_ms: base as i64,
            backoff_cap_ms: cap as i64,
            throttle: ThrottlePolicy {
                retry_after_max_ms: retry_after_max as i64,
                throttle_floor_ms: floor as i64,
                ratelimit_reset: self.ratelimit_reset,
            },
            throttle_backoff_base_ms: tb_base as i64,
            throttle_backoff_cap_ms: tb_cap as i64,
            max_throttles: max_throttles as i32,
            adaptive_rate: self.adaptive_rate.unwrap_or(false),
            paused: self.paused,
        })
    }
}

fn ms_range(field: &str, v: u64, lo: u64, hi: u64) -> Result<(), FieldError> {
    if (lo..=hi).contains(&v) {
        Ok(())
    } else {
        Err(FieldError::new(
            field,
            format!("{v} is out of range ({lo} to {hi})"),
        ))
    }
}

/// Attempts are bounded so a job cannot cycle for ever.
pub fn check_attempts(field: &str, n: u32) -> Result<(), FieldError> {
    if (1..=1_000).contains(&n) {
        Ok(())
    } else {
        Err(FieldError::new(
            field,
            format!("{n} is out of range (1 to 1000)"),
        ))
    }
}

fn parse_base_url(raw: &str) -> Result<Url, String> {
    let url = Url::parse(raw).map_err(|e| format!("{raw:?} is not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("{raw:?} must be an http or https URL"));
    }
    if url.host_str().is_none() {
        return Err(format!("{raw:?} has no host"));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(format!("{raw:?} must not have a query or fragment"));
    }
    Ok(url)
}

/// Parses a job's target URL: it must be absolute http(s) with a host.
pub fn parse_job_url(raw: &str) -> Result<Url, String> {
    let url = Url::parse(raw).map_err(|e| format!("{raw:?} is not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("{raw:?} must be an http or https URL"));
    }
    if url.host_str().is_none() {
        return Err(format!("{raw:?} has no host"));
    }
    Ok(url)
}

/// Whether `url` lies under one of `allowed` (empty = anything goes).
///
/// Scheme, host and port must match exactly, and the path must continue the base path
/// at a segment boundary: `https://api.example.com/v1` allows `/v1` and `/v1/x`, not
/// `/v10`.
pub fn url_allowed(url: &Url, allowed: &[String]) -> bool {
    if allowed.is_empty() {
        return true;
    }
    allowed.iter().any(|base| {
        let Ok(base) = Url::parse(base) else {
            return false;
        };
        if base.scheme() != url.scheme()
            || base.host_str() != url.host_str()
            || base.port_or_known_default() != url.port_or_known_default()
        {
            return false;
        }
        let bp = base.path();
        let p = url.path();
        if bp.ends_with('/') {
            p.starts_with(bp)
        } else {
            p == bp || (p.starts_with(bp) && p.as_bytes().get(bp.len()) == Some(&b'/'))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(json: serde_json::Value) -> Result<DestinationSpec, String> {
        let c: DestinationConfig = serde_json::from_value(json).map_err(|e| e.to_string())?;
        c.validate().map_err(|e| e.to_string())
    }

    #[test]
    fn names() {
        for ok in ["a", "sms:twilio-1", "A.b_c", &"x".repeat(128)] {
            assert!(DestinationName::parse(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a b", "a/b", "é", &"x".repeat(129), "a\n"] {
            assert!(DestinationName::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let s = cfg(serde_json::json!({"rate": "50/s", "capacity": 100})).expect("valid");
        assert_eq!(s.rate.interval_us(), 20_000);
        assert_eq!(s.burst, 1);
        assert_eq!(s.capacity, 100);
        assert_eq!(s.max_in_flight, None);
        assert_eq!(s.timeout_ms, 10_000);
        assert_eq!(s.max_attempts, 10);
        assert_eq!(s.paused, None);
    }

    #[test]
    fn errors_name_the_field_and_value() {
        let e = cfg(serde_json::json!({"rate": "50/s", "capacity": 0})).expect_err("bad");
        assert!(e.contains("capacity") && e.contains('0'), "{e}");
        let e = cfg(serde_json::json!({"rate": "0/s", "capacity": 1})).expect_err("bad");
        assert!(e.contains("0/s"), "{e}");
        let e = cfg(serde_json::json!({"rate": "5/s", "capacity": 1, "burst": 0})).expect_err("");
        assert!(e.starts_with("burst"), "{e}");
        let e = cfg(serde_json::json!({"rate": "5/s", "capacity": 1, "allowed_base_urls": ["http://ok/", "ftp://x/"]}))
            .expect_err("bad");
        assert!(
            e.contains("allowed_base_urls[1]") && e.contains("ftp://x/"),
            "{e}"
        );
        let e =
            cfg(serde_json::json!({"rate": "5/s", "capacity": 1, "colour": "red"})).expect_err("");
        assert!(e.contains("colour"), "{e}");
        let e = cfg(serde_json::json!({"rate": "5/s", "capacity": 1, "backoff_base_ms": 10, "backoff_cap_ms": 5}))
            .expect_err("bad");
        assert!(e.starts_with("backoff_cap_ms"), "{e}");
    }

    #[test]
    fn allowed_urls_respect_segments() {
        let allowed = vec![
            "https://api.example.com/v1".to_owned(),
            "http://127.0.0.1:9000/".to_owned(),
        ];
        let ok = |u: &str| url_allowed(&parse_job_url(u).expect("url"), &allowed);
        assert!(ok("https://api.example.com/v1"));
        assert!(ok("https://api.example.com/v1/messages?x=1"));
        assert!(ok("https://api.example.com:443/v1/x"));
        assert!(!ok("https://api.example.com/v10"));
        assert!(!ok("http://api.example.com/v1/x"));
        assert!(!ok("https://evil.example.com/v1/x"));
        assert!(ok("http://127.0.0.1:9000/anything"));
        assert!(!ok("http://127.0.0.1:9001/anything"));
        assert!(url_allowed(&parse_job_url("http://x/").expect("url"), &[]));
    }

    #[test]
    fn job_urls_must_be_http() {
        assert!(parse_job_url("http://x/y").is_ok());
        assert!(parse_job_url("ftp://x/y").is_err());
        assert!(parse_job_url("not a url").is_err());
        assert!(parse_job_url("/relative").is_err());
        assert!(parse_job_url("file:///etc/passwd").is_err());
    }
}
