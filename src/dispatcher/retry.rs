//! What an attempt's result means for the job: pure policy, unit-tested.

use crate::delivery::{DeliveryError, Response};
use crate::store::{ClaimedJob, Outcome};

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

/// Classifies an attempt. `throttle` decides 429/503 handling (the Throttling issue
/// plugs Retry-After in there); here they are ordinary retryable failures.
pub fn classify(job: &ClaimedJob, result: Result<Response, DeliveryError>) -> Outcome {
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

/// 408, 429 and every 5xx may succeed later; other statuses will not.
pub fn is_retryable_status(status: u16) -> bool {
    status == 408 || status == 429 || (500..600).contains(&status)
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
            deadline_us: None,
        }
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
            classify(&job(1, 3), resp(200)),
            Outcome::Succeeded { status: 200, .. }
        ));
        assert!(matches!(
            classify(&job(1, 3), resp(204)),
            Outcome::Succeeded { .. }
        ));
        for s in [500, 502, 503, 504, 408, 429] {
            assert!(
                matches!(classify(&job(1, 3), resp(s)), Outcome::Retry { .. }),
                "{s}"
            );
            assert!(
                matches!(classify(&job(3, 3), resp(s)), Outcome::Dead { .. }),
                "{s}"
            );
        }
        for s in [400, 401, 403, 404, 410, 422, 301, 302, 100] {
            assert!(
                matches!(classify(&job(1, 3), resp(s)), Outcome::Dead { .. }),
                "{s}"
            );
        }
    }

    #[test]
    fn network_errors() {
        let e = |e: DeliveryError| classify(&job(1, 3), Err(e));
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
            classify(&job(3, 3), Err(DeliveryError::Timeout(5))),
            Outcome::Dead { .. }
        ));
    }
}
