//! What an attempt's result means for the job and its destination: pure policy,
//! unit-tested.

use std::time::SystemTime;

use crate::delivery::{DeliveryError, Response};
use crate::store::{ClaimedJob, Outcome};
use crate::throttle::{self, Shift, Source};

/// Exponential backoff with full jitter: a uniformly random delay in
/// `[0, min(cap, base * 2^(attempt - 1))]`. Full jitter spreads retries of jobs that
/// failed together, so they do not return as a herd.
pub fn backoff_us(base_ms: i64, cap_ms: i64, attempt: i32, unit_random: f64) -> i64 {
    let exp = attempt.saturating_sub(1).clamp(0, 62) as u32;
    let ceiling_ms = base_ms
        .max(1)
        .checked_mul(1i64.checked_shl(exp).unwrap_or(i64::MAX))
        .unwrap_or(i64::MAX)
        .min(cap_ms.max(1));
    let ceiling_us = ceiling_ms.saturating_mul(1_000);
    (ceiling_us as f64 * unit_random.clamp(0.0, 1.0)) as i64
}

/// Classifies an attempt received at `received`: the job's outcome, and how the response
/// moves the destination's `next_slot` (see [`crate::throttle`]).
pub fn classify(
    job: &ClaimedJob,
    result: Result<Response, DeliveryError>,
    received: SystemTime,
) -> (Outcome, Option<Shift>) {
    let resp = match result {
        Ok(resp) => resp,
        Err(e) => return (classify_status(job, Err(e)), None),
    };
    let reading = throttle::read(resp.status, &resp.headers, received, &job.throttle);
    if !reading.throttled {
        return (classify_status(job, Ok(resp)), reading.shift);
    }
    let hint_ms = reading.shift.and_then(|s| s.delay_ms);
    let why = match reading.shift {
        Some(Shift {
            delay_ms: Some(ms),
            source,
            capped,
        }) => format!(
            "HTTP {}: throttled, destination waits {ms} ms ({}{})",
            resp.status,
            match source {
                Source::RetryAfter => "Retry-After",
                Source::RateLimit => "RateLimit",
                Source::XRateLimit => "X-RateLimit-Reset",
                Source::Backoff => "backoff",
            },
            if capped {
                ", capped at retry_after_max_ms"
            } else {
                ""
            }
        ),
        _ => format!(
            "HTTP {}: throttled without a wait hint; destination backs off",
            resp.status
        ),
    };
    let outcome = if job.throttles.saturating_add(1) >= job.max_throttles {
        Outcome::Dead {
            status: Some(resp.status),
            error: format!(
                "{why}; throttled {} times (max_throttles)",
                job.throttles + 1
            ),
            snippet: resp.snippet,
        }
    } else {
        Outcome::Throttled {
            status: resp.status,
            error: why,
            snippet: resp.snippet,
            retry_after_ms: hint_ms,
        }
    };
    (outcome, reading.shift)
}

/// The outcome by status and transport error alone (no throttling signals).
fn classify_status(job: &ClaimedJob, result: Result<Response, DeliveryError>) -> Outcome {
    let retry_or_dead = |status: Option<u16>, error: String, snippet: Option<String>| {
        if job.attempts >= job.max_attempts {
            Outcome::Dead {
                status,
                error: format!("{error} (attempt {} of {})", job.attempts, job.max_attempts),
                snippet,
            }
        } else {
            Outcome::Retry {
                status,
                error,
                snippet,
                delay_us: backoff_us(
                    job.backoff_base_ms,
                    job.backoff_cap_ms,
                    job.attempts,
                    fastrand::f64(),
                ),
            }
        }
    };
    match result {
        Ok(resp) => {
            let status = resp.status;
            if (200..300).contains(&status) {
                Outcome::Succeeded {
                    status,
                    snippet: resp.snippet,
                }
            } else if is_retryable_status(status) {
                retry_or_dead(Some(status), format!("HTTP {status}"), resp.snippet)
            } else {
                Outcome::Dead {
                    status: Some(status),
                    error: format!("HTTP {status} is not retryable"),
                    snippet: resp.snippet,
                }
            }
        }
        Err(e) if e.is_retryable() => retry_or_dead(None, e.to_string(), None),
        Err(e) => Outcome::Dead {
            status: None,
            error: e.to_string(),
            snippet: None,
        },
    }
}

/// 408 and every 5xx may succeed later; other statuses will not (429 is a throttle,
/// handled before this).
pub fn is_retryable_status(status: u16) -> bool {
    status == 408 || (500..600).contains(&status)
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderMap;
    use std::sync::Arc;

    fn job(attempts: i32, max_attempts: i32) -> ClaimedJob {
        ClaimedJob {
            id: uuid::Uuid::nil(),
            destination_id: 1,
            destination: Arc::from("d"),
            slot_us: 0,
            tat_before_us: 0,
            tat_after_us: 0,
            interval_us: 1,
            shared: false,
            burst: 1,
            timeout_ms: 1_000,
            backoff_base_ms: 100,
            backoff_cap_ms: 1_000,
            method: "POST".into(),
            url: "http://x/".into(),
            headers: vec![],
            body: None,
            attempts,
            max_attempts,
            throttles: 0,
            max_throttles: 3,
            throttle: crate::throttle::ThrottlePolicy::default(),
            deadline_us: None,
        }
    }

    fn outcome(job: &ClaimedJob, r: Result<Response, DeliveryError>) -> Outcome {
        classify(job, r, SystemTime::now()).0
    }

    fn resp(status: u16) -> Result<Response, DeliveryError> {
        Ok(Response {
            status,
            headers: HeaderMap::new(),
            snippet: None,
        })
    }

    #[test]
    fn backoff_grows_and_caps() {
        assert_eq!(backoff_us(100, 1_000, 1, 1.0), 100_000);
        assert_eq!(backoff_us(100, 1_000, 2, 1.0), 200_000);
        assert_eq!(backoff_us(100, 1_000, 4, 1.0), 800_000);
        assert_eq!(backoff_us(100, 1_000, 5, 1.0), 1_000_000);
        assert_eq!(backoff_us(100, 1_000, 1_000, 1.0), 1_000_000);
        assert_eq!(backoff_us(100, 1_000, 3, 0.0), 0);
        assert_eq!(backoff_us(100, 1_000, 3, 0.5), 200_000);
        assert_eq!(backoff_us(i64::MAX, i64::MAX, i32::MAX, 1.0), i64::MAX);
        assert_eq!(backoff_us(100, 1_000, i32::MIN, 1.0), 100_000);
    }

    #[test]
    fn outcomes_by_status() {
        assert!(matches!(
            outcome(&job(1, 3), resp(200)),
            Outcome::Succeeded { status: 200, .. }
        ));
        assert!(matches!(
            outcome(&job(1, 3), resp(204)),
            Outcome::Succeeded { .. }
        ));
        for s in [500, 502, 503, 504, 408] {
            assert!(
                matches!(outcome(&job(1, 3), resp(s)), Outcome::Retry { .. }),
                "{s}"
            );
            assert!(
                matches!(outcome(&job(3, 3), resp(s)), Outcome::Dead { .. }),
                "{s}"
            );
        }
        for s in [400, 401, 403, 404, 410, 422, 301, 302, 100] {
            assert!(
                matches!(outcome(&job(1, 3), resp(s)), Outcome::Dead { .. }),
                "{s}"
            );
        }
    }

    #[test]
    fn throttles_do_not_spend_attempts_until_max_throttles() {
        let mut h = HeaderMap::new();
        h.insert("retry-after", "2".parse().expect("value"));
        let r = || {
            Ok(Response {
                status: 429,
                headers: h.clone(),
                snippet: None,
            })
        };
        // Even on the last attempt a throttle is not a failure.
        let (o, shift) = classify(&job(3, 3), r(), SystemTime::now());
        assert!(
            matches!(
                o,
                Outcome::Throttled {
                    status: 429,
                    retry_after_ms: Some(2_000),
                    ..
                }
            ),
            "{o:?}"
        );
        assert_eq!(shift.and_then(|s| s.delay_ms), Some(2_000));
        let mut j = job(1, 3);
        j.throttles = 2;
        let (o, shift) = classify(&j, r(), SystemTime::now());
        assert!(
            matches!(o, Outcome::Dead { .. }),
            "max_throttles reached: {o:?}"
        );
        assert!(shift.is_some(), "the destination still waits");
        // 503 with Retry-After throttles; without, it is a failure.
        let (o, _) = classify(
            &job(1, 3),
            Ok(Response {
                status: 503,
                headers: h.clone(),
                snippet: None,
            }),
            SystemTime::now(),
        );
        assert!(matches!(o, Outcome::Throttled { .. }));
        // 429 without any hint: throttled, destination backs off.
        let (o, shift) = classify(&job(1, 3), resp(429), SystemTime::now());
        assert!(matches!(
            o,
            Outcome::Throttled {
                retry_after_ms: None,
                ..
            }
        ));
        assert_eq!(shift.map(|s| s.source), Some(Source::Backoff));
    }

    #[test]
    fn network_errors() {
        let e = |e: DeliveryError| outcome(&job(1, 3), Err(e));
        assert!(matches!(
            e(DeliveryError::Timeout(5)),
            Outcome::Retry { .. }
        ));
        assert!(matches!(
            e(DeliveryError::Connect("refused".into())),
            Outcome::Retry { .. }
        ));
        assert!(matches!(
            e(DeliveryError::Transport("reset".into())),
            Outcome::Retry { .. }
        ));
        assert!(matches!(
            e(DeliveryError::Invalid("bad".into())),
            Outcome::Dead { .. }
        ));
        assert!(matches!(
            outcome(&job(3, 3), Err(DeliveryError::Timeout(5))),
            Outcome::Dead { .. }
        ));
    }
}
