//! Jobs: what producers submit ([`JobRequest`] → [`NewJob`]) and what the store keeps
//! ([`Job`], [`JobState`]).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use reqwest::header::{HeaderName, HeaderValue};
use reqwest::Method;
use serde::{Deserialize, Serialize, Serializer};
use uuid::Uuid;

use crate::destination::{check_attempts, parse_job_url, FieldError};
use crate::rate::Micros;
use crate::timestamp::{format_us, parse_rfc3339};

/// A job's place in its lifecycle (see `docs/state_machine.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    /// Admitted and waiting for a slot. Left by a claim (→ running), a cancel, or expiry.
    Queued,
    /// Claimed by a dispatcher with a slot; the request is pending or in flight. Left by
    /// the outcome of the request, or by lease expiry / shutdown (→ queued).
    Running,
    /// The downstream answered 2xx. Final.
    Succeeded,
    /// Permanently failed or out of attempts. Final until retried by an operator.
    Dead,
    /// Cancelled while queued. Final.
    Cancelled,
    /// Its deadline passed before it could be sent. Final; it was never sent.
    Expired,
}

impl JobState {
    /// All states, in lifecycle order.
    pub const ALL: [JobState; 6] = [
        JobState::Queued,
        JobState::Running,
        JobState::Succeeded,
        JobState::Dead,
        JobState::Cancelled,
        JobState::Expired,
    ];

    /// The name stored in the database and shown in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Dead => "dead",
            JobState::Cancelled => "cancelled",
            JobState::Expired => "expired",
        }
    }

    /// Whether the job will never be sent again on its own.
    pub fn is_final(self) -> bool {
        !matches!(self, JobState::Queued | JobState::Running)
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for JobState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        JobState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| {
                format!("unknown job state {s:?} (queued, running, succeeded, dead, cancelled, expired)")
            })
    }
}

/// A job as submitted over HTTP, the CLI or the library.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct JobRequest {
    /// Absolute http(s) URL, under one of the destination's allowed base URLs.
    pub url: String,
    /// HTTP method, default `POST`.
    #[serde(default)]
    pub method: Option<String>,
    /// Request headers.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Raw request body (mutually exclusive with `json`).
    #[serde(default)]
    pub body: Option<String>,
    /// JSON request body, sent with `Content-Type: application/json` unless overridden.
    #[serde(default)]
    pub json: Option<serde_json::Value>,
    /// Deduplicates enqueues per destination: a repeat returns the existing job.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// RFC 3339; the job is not sent before this instant.
    #[serde(default)]
    pub not_before: Option<String>,
    /// RFC 3339; a job not sent by then becomes `expired` and is never sent.
    #[serde(default)]
    pub deadline: Option<String>,
    /// Overrides the destination's `max_attempts` for this job.
    #[serde(default)]
    pub max_attempts: Option<u32>,
}

/// Headers the HTTP client owns; letting jobs set them would corrupt the request framing.
const RESERVED_HEADERS: [&str; 9] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "proxy-connection",
];

/// Limits on what one job may carry besides its body.
const MAX_HEADERS: usize = 100;
const MAX_IDEMPOTENCY_KEY: usize = 255;
const MAX_URL: usize = 8_192;

/// A validated job, ready for admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewJob {
    /// HTTP method.
    pub method: String,
    /// Target URL (checked against the destination's allow-list at admission).
    pub url: String,
    /// Headers in submission order.
    pub headers: Vec<(String, String)>,
    /// Request body bytes.
    pub body: Option<Vec<u8>>,
    /// Per-destination deduplication key.
    pub idempotency_key: Option<String>,
    /// Earliest release, Unix microseconds.
    pub not_before_us: Option<Micros>,
    /// Expiry, Unix microseconds.
    pub deadline_us: Option<Micros>,
    /// Overrides the destination default.
    pub max_attempts: Option<i32>,
}

impl JobRequest {
    /// Validates the request. Field names in errors are prefixed with `prefix` (used for
    /// `jobs[3].` in batches).
    pub fn validate(&self, prefix: &str) -> Result<NewJob, FieldError> {
        let field = |name: &str| format!("{prefix}{name}");
        let bad = |name: &str, message: String| FieldError {
            field: field(name),
            message,
        };
        if self.url.len() > MAX_URL {
            return Err(bad("url", format!("longer than {MAX_URL} bytes")));
        }
        let url = parse_job_url(&self.url).map_err(|m| bad("url", m))?;
        let method = match &self.method {
            None => "POST".to_owned(),
            Some(m) => {
                let parsed = Method::from_bytes(m.as_bytes())
                    .map_err(|_| bad("method", format!("{m:?} is not an HTTP method")))?;
                parsed.as_str().to_owned()
            }
        };
        if self.headers.len() > MAX_HEADERS {
            return Err(bad("headers", format!("more than {MAX_HEADERS} headers")));
        }
        let mut headers = Vec::with_capacity(self.headers.len() + 1);
        for (name, value) in &self.headers {
            let hn = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| bad("headers", format!("{name:?} is not a valid header name")))?;
            if RESERVED_HEADERS.contains(&hn.as_str()) {
                return Err(bad(
                    "headers",
                    format!("{name:?} is set by Sluice and cannot be overridden"),
                ));
            }
            HeaderValue::from_str(value).map_err(|_| {
                bad(
                    "headers",
                    format!("the value of {name:?} is not a valid header value"),
                )
            })?;
            headers.push((name.clone(), value.clone()));
        }
        let body = match (&self.body, &self.json) {
            (Some(_), Some(_)) => {
                return Err(bad("body", "give either body or json, not both".to_owned()))
            }
            (Some(b), None) => Some(b.clone().into_bytes()),
            (None, Some(j)) => {
                if !headers
                    .iter()
                    .any(|(n, _)| n.eq_ignore_ascii_case("content-type"))
                {
                    headers.push(("content-type".to_owned(), "application/json".to_owned()));
                }
                Some(serde_json::to_vec(j).map_err(|e| bad("json", e.to_string()))?)
            }
            (None, None) => None,
        };
        if let Some(k) = &self.idempotency_key {
            if k.is_empty() || k.len() > MAX_IDEMPOTENCY_KEY {
                return Err(bad(
                    "idempotency_key",
                    format!("must be 1 to {MAX_IDEMPOTENCY_KEY} bytes"),
                ));
            }
        }
        let not_before_us = self
            .not_before
            .as_deref()
            .map(parse_rfc3339)
            .transpose()
            .map_err(|m| bad("not_before", m))?;
        let deadline_us = self
            .deadline
            .as_deref()
            .map(parse_rfc3339)
            .transpose()
            .map_err(|m| bad("deadline", m))?;
        if let (Some(nb), Some(dl)) = (not_before_us, deadline_us) {
            if dl <= nb {
                return Err(bad("deadline", "must be after not_before".to_owned()));
            }
        }
        let max_attempts = match self.max_attempts {
            None => None,
            Some(n) => {
                check_attempts(&field("max_attempts"), n)?;
                Some(n as i32)
            }
        };
        Ok(NewJob {
            method,
            url: url.to_string(),
            headers,
            body,
            idempotency_key: self.idempotency_key.clone(),
            not_before_us,
            deadline_us,
            max_attempts,
        })
    }
}

/// A job as stored, for the API, the CLI and tests.
#[derive(Debug, Clone, Serialize)]
pub struct Job {
    /// UUIDv7; also the `Idempotency-Key` sent downstream.
    pub id: Uuid,
    /// Destination name.
    pub destination: String,
    /// Lifecycle state.
    pub state: JobState,
    /// HTTP method.
    pub method: String,
    /// Target URL.
    pub url: String,
    /// Request headers.
    pub headers: Vec<(String, String)>,
    /// Size of the request body.
    pub body_bytes: i64,
    /// Producer-supplied deduplication key.
    pub idempotency_key: Option<String>,
    /// Attempts spent so far (throttled attempts are not counted).
    pub attempts: i32,
    /// Attempts allowed before the job is dead.
    pub max_attempts: i32,
    /// Times the downstream throttled this job (429, or 503 with Retry-After).
    pub throttles: i32,
    /// The wait the latest throttle asked for, in milliseconds (after floor and cap).
    pub last_retry_after_ms: Option<i64>,
    /// The job is not released before this (enqueue time, `not_before`, or a backoff).
    #[serde(serialize_with = "ser_ts")]
    pub run_at: Micros,
    /// The job expires if not sent by then.
    #[serde(serialize_with = "ser_opt_ts")]
    pub deadline: Option<Micros>,
    /// Release slot of the current or latest claim.
    #[serde(serialize_with = "ser_opt_ts")]
    pub slot: Option<Micros>,
    /// Status of the latest response.
    pub last_status: Option<i32>,
    /// Error of the latest attempt.
    pub last_error: Option<String>,
    /// Start of the latest response body (truncated).
    pub response_snippet: Option<String>,
    /// Enqueue time.
    #[serde(serialize_with = "ser_ts")]
    pub created_at: Micros,
    /// Last state change.
    #[serde(serialize_with = "ser_ts")]
    pub updated_at: Micros,
    /// When the job reached a final state.
    #[serde(serialize_with = "ser_opt_ts")]
    pub finished_at: Option<Micros>,
}

fn ser_ts<S: Serializer>(us: &Micros, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_us(*us))
}

fn ser_opt_ts<S: Serializer>(us: &Option<Micros>, s: S) -> Result<S::Ok, S::Error> {
    match us {
        Some(us) => s.serialize_str(&format_us(*us)),
        None => s.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: serde_json::Value) -> Result<NewJob, String> {
        let r: JobRequest = serde_json::from_value(v).map_err(|e| e.to_string())?;
        r.validate("").map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_and_json_body() {
        let j = req(serde_json::json!({"url": "http://x/y", "json": {"a": 1}})).expect("valid");
        assert_eq!(j.method, "POST");
        assert_eq!(j.body.as_deref(), Some(&b"{\"a\":1}"[..]));
        assert_eq!(
            j.headers,
            vec![("content-type".to_owned(), "application/json".to_owned())]
        );
    }

    #[test]
    fn explicit_content_type_wins() {
        let j = req(serde_json::json!({"url": "http://x/", "json": 1, "headers": {"Content-Type": "text/plain"}}))
            .expect("valid");
        assert_eq!(j.headers.len(), 1);
    }

    #[test]
    fn rejects_bad_fields() {
        let cases = [
            (serde_json::json!({"url": "ftp://x/"}), "url"),
            (
                serde_json::json!({"url": "http://x/", "method": "GE T"}),
                "method",
            ),
            (
                serde_json::json!({"url": "http://x/", "headers": {"Host": "y"}}),
                "headers",
            ),
            (
                serde_json::json!({"url": "http://x/", "headers": {"a b": "y"}}),
                "headers",
            ),
            (
                serde_json::json!({"url": "http://x/", "headers": {"a": "line\nbreak"}}),
                "headers",
            ),
            (
                serde_json::json!({"url": "http://x/", "body": "a", "json": 1}),
                "body",
            ),
            (
                serde_json::json!({"url": "http://x/", "idempotency_key": ""}),
                "idempotency_key",
            ),
            (
                serde_json::json!({"url": "http://x/", "not_before": "soon"}),
                "not_before",
            ),
            (
                serde_json::json!({"url": "http://x/", "max_attempts": 0}),
                "max_attempts",
            ),
            (
                serde_json::json!({"url": "http://x/", "not_before": "2026-01-02T00:00:00Z", "deadline": "2026-01-01T00:00:00Z"}),
                "deadline",
            ),
        ];
        for (v, field) in cases {
            let e = req(v.clone()).expect_err("invalid");
            assert!(e.starts_with(field), "{v}: {e}");
        }
        assert!(req(serde_json::json!({"method": "GET"})).is_err());
        assert!(req(serde_json::json!({"url": "http://x/", "extra": 1})).is_err());
    }

    #[test]
    fn states_round_trip() {
        for s in JobState::ALL {
            assert_eq!(s.as_str().parse::<JobState>(), Ok(s));
        }
        assert!("done".parse::<JobState>().is_err());
        assert!(JobState::Dead.is_final() && !JobState::Running.is_final());
    }
}
