//! Reading a downstream's throttling signals: `Retry-After`, `RateLimit`, and the
//! `X-RateLimit-*` family. Pure and total: any byte sequence a server sends produces a
//! decision, never a panic (fuzzed in the tests below).
//!
//! The rules (README "How downstream signals are read" has the user-facing table):
//!
//! * **Which responses throttle.** A `429`, or a `503` *with* a valid `Retry-After`, is a
//!   throttle: the job goes back to the head of its line without spending an attempt, and
//!   the destination's `next_slot` moves to `max(next_slot, now + delay)`. Any response
//!   (even a 2xx) whose rate-limit headers announce exhaustion moves `next_slot` the same
//!   way without touching the job's outcome.
//! * **Delay, in order of precedence.** (1) `Retry-After`: delay-seconds (`^[0-9]+$`,
//!   leniently also `^[0-9]+\.[0-9]+$`, rounded up) or an HTTP-date in any of the three
//!   RFC 9110 formats, measured from the response's `Date` header when it has a valid
//!   one, else from the local receive time; several field lines → the largest valid value;
//!   unparseable values are ignored. (2) `RateLimit` (IETF draft): an item with `r=0` and
//!   `t=N` means N seconds. (3) `X-RateLimit-Remaining: 0` with `X-RateLimit-Reset` (or
//!   the older `RateLimit-Remaining`/`RateLimit-Reset`), read as delta or epoch seconds as
//!   the destination says (`ratelimit_reset`); never guessed. (4) A `429` with none of
//!   these: the destination's throttle backoff, doubling with each consecutive 429 and
//!   reset by a success (computed by the store, which keeps the streak).
//! * **Bounds.** A 429 waits at least `throttle_floor_ms` (a hint of 0 or a past date means
//!   "now", but not faster than that floor). Every delay is capped at `retry_after_max_ms`
//!   (the response is flagged as capped). Arithmetic saturates; no jitter is added — the
//!   destination resumes at exactly its configured spacing, which already spreads the
//!   backlog instead of releasing it as a herd.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::header::{HeaderMap, HeaderValue, DATE, RETRY_AFTER};
use serde::{Deserialize, Serialize};

/// How a destination's `X-RateLimit-Reset` / `RateLimit-Reset` values are read. Providers
/// disagree (GitHub and SendGrid send epoch seconds, Resend and Discord send delays), so
/// this is configured, not guessed; unset ignores those headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResetUnit {
    /// Seconds from now (fractions allowed).
    Delta,
    /// Unix epoch seconds (fractions allowed).
    Epoch,
}

impl ResetUnit {
    /// Stored form.
    pub fn as_str(self) -> &'static str {
        match self {
            ResetUnit::Delta => "delta",
            ResetUnit::Epoch => "epoch",
        }
    }

    /// Parses the stored form.
    pub fn parse(s: &str) -> Option<ResetUnit> {
        match s {
            "delta" => Some(ResetUnit::Delta),
            "epoch" => Some(ResetUnit::Epoch),
            _ => None,
        }
    }
}

/// A destination's throttling settings, as the classifier needs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThrottlePolicy {
    /// Largest delay honoured; longer hints are clamped.
    pub retry_after_max_ms: i64,
    /// Least delay after a 429.
    pub throttle_floor_ms: i64,
    /// How to read `X-RateLimit-Reset`; `None` ignores the X-RateLimit family.
    pub ratelimit_reset: Option<ResetUnit>,
}

impl Default for ThrottlePolicy {
    fn default() -> Self {
        Self {
            retry_after_max_ms: 3_600_000,
            throttle_floor_ms: 1_000,
            ratelimit_reset: None,
        }
    }
}

/// Where a delay came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `Retry-After`.
    RetryAfter,
    /// IETF `RateLimit` (`r=0;t=N`).
    RateLimit,
    /// `X-RateLimit-Remaining: 0` + `X-RateLimit-Reset` (or the old-draft names).
    XRateLimit,
    /// A 429 without a usable hint: the destination's growing backoff.
    Backoff,
}

/// What a response asks of the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shift {
    /// Delay before the next release, in milliseconds; `None` for [`Source::Backoff`]
    /// (the store computes it from the destination's streak).
    pub delay_ms: Option<i64>,
    /// The signal used.
    pub source: Source,
    /// The hint exceeded `retry_after_max_ms` and was clamped.
    pub capped: bool,
}

/// The reading of one response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    /// The job was throttled (429, or 503 with Retry-After): requeue it at the head
    /// without spending an attempt.
    pub throttled: bool,
    /// How to move the destination's `next_slot`, if at all.
    pub shift: Option<Shift>,
}

/// Reads a response. `received` is the local time the response arrived.
pub fn read(
    status: u16,
    headers: &HeaderMap,
    received: SystemTime,
    policy: &ThrottlePolicy,
) -> Reading {
    let reference = reference_time(headers, received);
    let retry_after = retry_after_secs(headers.get_all(RETRY_AFTER).iter(), reference);
    let throttled = status == 429 || (status == 503 && retry_after.is_some());
    let hint = if throttled {
        retry_after
            .map(|s| (s, Source::RetryAfter))
            .or_else(|| ratelimit_secs(headers).map(|s| (s, Source::RateLimit)))
            .or_else(|| {
                x_ratelimit_secs(headers, policy.ratelimit_reset, reference)
                    .map(|s| (s, Source::XRateLimit))
            })
    } else {
        // Not throttled: only an announcement of exhaustion moves the slot.
        ratelimit_secs(headers)
            .map(|s| (s, Source::RateLimit))
            .or_else(|| {
                x_ratelimit_secs(headers, policy.ratelimit_reset, reference)
                    .map(|s| (s, Source::XRateLimit))
            })
    };
    let shift = match hint {
        Some((secs, source)) => {
            let raw_ms = secs.saturating_mul(1_000).min(i64::MAX as u64) as i64;
            let floored = if throttled {
                raw_ms.max(policy.throttle_floor_ms)
            } else {
                raw_ms
            };
            let capped = floored > policy.retry_after_max_ms;
            let delay_ms = floored.min(policy.retry_after_max_ms).max(0);
            (throttled || delay_ms > 0).then_some(Shift {
                delay_ms: Some(delay_ms),
                source,
                capped,
            })
        }
        None if throttled => Some(Shift {
            delay_ms: None,
            source: Source::Backoff,
            capped: false,
        }),
        None => None,
    };
    Reading { throttled, shift }
}

/// The instant delays are measured from: the response's `Date` when valid (the server's
/// clock, so its dates mean what it meant), else the local receive time.
fn reference_time(headers: &HeaderMap, received: SystemTime) -> SystemTime {
    headers
        .get(DATE)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| httpdate::parse_http_date(s.trim()).ok())
        .unwrap_or(received)
}

/// Parses every `Retry-After` field line and returns the largest valid delay in whole
/// seconds (rounded up), or `None` when there is no valid value.
pub fn retry_after_secs<'a>(
    values: impl Iterator<Item = &'a HeaderValue>,
    reference: SystemTime,
) -> Option<u64> {
    values.filter_map(|v| parse_retry_after(v, reference)).max()
}

/// One `Retry-After` value: delay-seconds, a decimal (rounded up), or an HTTP-date.
fn parse_retry_after(value: &HeaderValue, reference: SystemTime) -> Option<u64> {
    let s = value.to_str().ok()?.trim_matches([' ', '\t']);
    if s.is_empty() {
        return None;
    }
    if let Some(secs) = parse_seconds(s) {
        return Some(secs);
    }
    let date = httpdate::parse_http_date(s).ok()?;
    Some(date.duration_since(reference).map(ceil_secs).unwrap_or(0))
}

/// `^[0-9]+$` (saturating: an overflowing value is huge, not malformed) or
/// `^[0-9]+\.[0-9]+$` rounded up. Signs, exponents, `inf` and `NaN` are malformed.
fn parse_seconds(s: &str) -> Option<u64> {
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (s, None),
    };
    if int.is_empty() || !int.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let whole = int.bytes().fold(0u64, |acc, b| {
        acc.saturating_mul(10).saturating_add(u64::from(b - b'0'))
    });
    match frac {
        None => Some(whole),
        Some(f) if !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit()) => {
            let round_up = f.bytes().any(|b| b != b'0');
            Some(whole.saturating_add(u64::from(round_up)))
        }
        Some(_) => None,
    }
}

fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// IETF `RateLimit` (draft-ietf-httpapi-ratelimit-headers): a list of items such as
/// `"default";r=0;t=30`. Returns the largest `t` among items with `r=0`. Items that are
/// malformed (a token instead of a string, a missing or non-integer `r`) are ignored; a
/// field that cannot be parsed at all is ignored as a whole, as the draft requires.
pub fn ratelimit_secs(headers: &HeaderMap) -> Option<u64> {
    let mut best: Option<u64> = None;
    for value in headers.get_all("ratelimit") {
        let Ok(text) = value.to_str() else { continue };
        let Some(items) = parse_sf_list(text) else {
            continue;
        };
        for item in items {
            if item.r == Some(0) {
                if let Some(t) = item.t {
                    best = Some(best.map_or(t, |b| b.max(t)));
                }
            }
        }
    }
    best
}

struct RateLimitItem {
    r: Option<u64>,
    t: Option<u64>,
}

/// A small Structured Fields (RFC 9651) list reader, enough for `RateLimit`: each member
/// a string with integer parameters. Returns `None` when the field is malformed as a whole;
/// members that are not strings are kept out (malformed items).
fn parse_sf_list(text: &str) -> Option<Vec<RateLimitItem>> {
    let b = text.as_bytes();
    let mut i = 0;
    let mut out = Vec::new();
    let skip_ows = |i: &mut usize| {
        while *i < b.len() && (b[*i] == b' ' || b[*i] == b'\t') {
            *i += 1;
        }
    };
    skip_ows(&mut i);
    if i == b.len() {
        return None;
    }
    loop {
        // Bare item: a string ("..."), or something else we skip over as malformed.
        let is_string = b.get(i) == Some(&b'"');
        if is_string {
            i += 1;
            loop {
                match b.get(i) {
                    None => return None,
                    Some(b'\\') => i += 2,
                    Some(b'"') => {
                        i += 1;
                        break;
                    }
                    Some(c) if (0x20..0x7f).contains(c) => i += 1,
                    Some(_) => return None,
                }
            }
        } else {
            let start = i;
            while i < b.len() && !matches!(b[i], b';' | b',') {
                i += 1;
            }
            if i == start {
                return None;
            }
        }
        // Parameters.
        let mut item = RateLimitItem { r: None, t: None };
        let mut item_ok = is_string;
        while b.get(i) == Some(&b';') {
            i += 1;
            skip_ows(&mut i);
            let key_start = i;
            while i < b.len()
                && (b[i].is_ascii_lowercase()
                    || b[i].is_ascii_digit()
                    || matches!(b[i], b'_' | b'-' | b'.' | b'*'))
            {
                i += 1;
            }
            let key = &text[key_start..i];
            if key.is_empty() {
                return None;
            }
            let mut value: Option<u64> = None;
            if b.get(i) == Some(&b'=') {
                i += 1;
                let v_start = i;
                while i < b.len() && !matches!(b[i], b';' | b',' | b' ' | b'\t') {
                    i += 1;
                }
                let raw = &text[v_start..i];
                value = if !raw.is_empty()
                    && raw.len() <= 15
                    && raw.bytes().all(|c| c.is_ascii_digit())
                {
                    raw.parse().ok()
                } else {
                    None
                };
                if (key == "r" || key == "t") && value.is_none() {
                    item_ok = false;
                }
            }
            match key {
                "r" => item.r = value,
                "t" => item.t = value,
                _ => {}
            }
        }
        if item_ok && item.r.is_some() {
            out.push(item);
        }
        skip_ows(&mut i);
        match b.get(i) {
            None => return Some(out),
            Some(b',') => {
                i += 1;
                skip_ows(&mut i);
                if i == b.len() {
                    return None;
                }
            }
            Some(_) => return None,
        }
    }
}

/// `X-RateLimit-Remaining: 0` with `X-RateLimit-Reset` (or `RateLimit-Remaining` /
/// `RateLimit-Reset`), read per the destination's `ratelimit_reset`. Returns seconds from
/// `reference`, rounded up.
pub fn x_ratelimit_secs(
    headers: &HeaderMap,
    unit: Option<ResetUnit>,
    reference: SystemTime,
) -> Option<u64> {
    let unit = unit?;
    for (remaining, reset) in [
        ("x-ratelimit-remaining", "x-ratelimit-reset"),
        ("ratelimit-remaining", "ratelimit-reset"),
    ] {
        let exhausted = headers
            .get(remaining)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| parse_decimal_ms(v.trim()) == Some(0));
        if !exhausted {
            continue;
        }
        let Some(ms) = headers
            .get(reset)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_decimal_ms(v.trim()))
        else {
            continue;
        };
        let delay_ms = match unit {
            ResetUnit::Delta => ms,
            ResetUnit::Epoch => {
                let now_ms = reference
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_millis().min(u128::from(u64::MAX)) as u64)
                    .unwrap_or(0);
                ms.saturating_sub(now_ms)
            }
        };
        return Some(delay_ms.div_ceil(1_000));
    }
    None
}

/// A non-negative decimal number of seconds, as milliseconds (rounded up).
fn parse_decimal_ms(s: &str) -> Option<u64> {
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    if int.is_empty()
        || !int.bytes().all(|b| b.is_ascii_digit())
        || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    if s.ends_with('.') {
        return None;
    }
    let whole = int.bytes().fold(0u64, |acc, b| {
        acc.saturating_mul(10).saturating_add(u64::from(b - b'0'))
    });
    let mut ms = whole.saturating_mul(1_000);
    let digits: Vec<u64> = frac.bytes().map(|b| u64::from(b - b'0')).collect();
    let mut scale = 100;
    for (k, d) in digits.iter().enumerate() {
        if k < 3 {
            ms = ms.saturating_add(d * scale);
            scale /= 10;
        } else if *d != 0 {
            ms = ms.saturating_add(1);
            break;
        }
    }
    Some(ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `received_at` = `Date` = 2026-01-01T00:00:00Z, as in the reference test vectors.
    const T0: u64 = 1_767_225_600;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn policy() -> ThrottlePolicy {
        ThrottlePolicy {
            retry_after_max_ms: 3_600_000,
            throttle_floor_ms: 1_000,
            ratelimit_reset: Some(ResetUnit::Epoch),
        }
    }

    fn hdrs(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                reqwest::header::HeaderName::from_bytes(k.as_bytes()).expect("name"),
                HeaderValue::from_str(v).expect("value"),
            );
        }
        h
    }

    fn delay(status: u16, pairs: &[(&str, &str)]) -> Option<(Option<i64>, Source, bool)> {
        let mut all = vec![("date", "Thu, 01 Jan 2026 00:00:00 GMT")];
        all.extend_from_slice(pairs);
        read(status, &hdrs(&all), at(T0), &policy())
            .shift
            .map(|s| (s.delay_ms, s.source, s.capped))
    }

    fn secs(n: i64) -> Option<(Option<i64>, Source, bool)> {
        Some((Some(n * 1_000), Source::RetryAfter, false))
    }

    #[test]
    fn reference_vectors_retry_after() {
        assert_eq!(delay(429, &[("retry-after", "120")]), secs(120));
        assert_eq!(delay(429, &[("retry-after", "  120 ")]), secs(120));
        assert_eq!(delay(429, &[("retry-after", "0")]), secs(1), "floor");
        assert_eq!(
            delay(429, &[("retry-after", "Thu, 01 Jan 2026 00:02:00 GMT")]),
            secs(120)
        );
        assert_eq!(
            delay(429, &[("retry-after", "Thursday, 01-Jan-26 00:02:00 GMT")]),
            secs(120)
        );
        assert_eq!(
            delay(429, &[("retry-after", "Thu Jan  1 00:02:00 2026")]),
            secs(120)
        );
        assert_eq!(
            delay(429, &[("retry-after", "Wed, 31 Dec 2025 23:00:00 GMT")]),
            secs(1),
            "past date → floor"
        );
        assert_eq!(delay(429, &[("retry-after", "1.5")]), secs(2));
        assert_eq!(
            delay(429, &[("retry-after", "99999999999999999999999")]),
            Some((Some(3_600_000), Source::RetryAfter, true))
        );
        assert_eq!(
            delay(429, &[("retry-after", "Fri, 31 Dec 9999 23:59:59 GMT")]),
            Some((Some(3_600_000), Source::RetryAfter, true))
        );
        assert_eq!(
            delay(429, &[("retry-after", "10"), ("retry-after", "60")]),
            secs(60)
        );
        assert_eq!(delay(503, &[("retry-after", "300")]), secs(300));
    }

    #[test]
    fn malformed_retry_after_falls_back_to_backoff() {
        for bad in [
            "-5", "+5", "5s", "abc", "", "inf", "NaN", "1e3", "1.", ".5", "10, 60", "banana",
        ] {
            let r = delay(429, &[("retry-after", bad)]);
            assert_eq!(r, Some((None, Source::Backoff, false)), "{bad:?}");
        }
        // A valid line wins over a malformed one.
        assert_eq!(
            delay(429, &[("retry-after", "abc"), ("retry-after", "7")]),
            secs(7)
        );
    }

    #[test]
    fn which_statuses_throttle() {
        let h = hdrs(&[("retry-after", "300")]);
        let r = read(500, &h, at(T0), &policy());
        assert!(
            !r.throttled && r.shift.is_none(),
            "500 with Retry-After is an ordinary failure"
        );
        assert!(
            !read(503, &HeaderMap::new(), at(T0), &policy()).throttled,
            "503 without hint"
        );
        assert!(read(503, &h, at(T0), &policy()).throttled);
        let r = read(429, &HeaderMap::new(), at(T0), &policy());
        assert!(r.throttled);
        assert_eq!(r.shift.map(|s| s.source), Some(Source::Backoff));
        assert_eq!(read(200, &HeaderMap::new(), at(T0), &policy()).shift, None);
        assert_eq!(
            read(302, &h, at(T0), &policy()).shift,
            None,
            "3xx Retry-After ignored"
        );
    }

    #[test]
    fn ratelimit_draft_fields() {
        assert_eq!(
            delay(429, &[("ratelimit", "\"default\";r=0;t=30")]),
            Some((Some(30_000), Source::RateLimit, false))
        );
        assert_eq!(
            delay(
                429,
                &[("retry-after", "5"), ("ratelimit", "\"default\";r=0;t=30")]
            ),
            secs(5),
            "Retry-After takes precedence"
        );
        assert_eq!(
            delay(200, &[("ratelimit", "\"default\";r=0;t=30")]),
            Some((Some(30_000), Source::RateLimit, false)),
            "exhaustion on a success still moves the slot"
        );
        assert_eq!(
            delay(200, &[("ratelimit", "default;r=0;t=30")]),
            None,
            "token item is malformed"
        );
        assert_eq!(
            delay(200, &[("ratelimit", "\"default\";r=5;t=30")]),
            None,
            "quota left"
        );
        assert_eq!(
            delay(
                200,
                &[("ratelimit", "\"burst\";r=3;t=1, \"daily\";r=0;t=600")]
            ),
            Some((Some(600_000), Source::RateLimit, false))
        );
        assert_eq!(delay(200, &[("ratelimit", "\"x\";r=0;t=abc")]), None);
        assert_eq!(
            delay(200, &[("ratelimit", "\"x\";r=0;t=30,")]),
            None,
            "trailing comma"
        );
        assert_eq!(
            delay(200, &[("ratelimit", "\"unterminated;r=0;t=30")]),
            None
        );
    }

    #[test]
    fn x_ratelimit_family_by_configured_unit() {
        // Epoch (GitHub, SendGrid): reset at T0 + 120.
        assert_eq!(
            delay(
                429,
                &[
                    ("x-ratelimit-remaining", "0"),
                    ("x-ratelimit-reset", "1767225720")
                ]
            ),
            Some((Some(120_000), Source::XRateLimit, false))
        );
        assert_eq!(
            delay(
                200,
                &[
                    ("x-ratelimit-remaining", "0"),
                    ("x-ratelimit-reset", "1767225720")
                ]
            ),
            Some((Some(120_000), Source::XRateLimit, false))
        );
        assert_eq!(
            delay(
                200,
                &[
                    ("x-ratelimit-remaining", "3"),
                    ("x-ratelimit-reset", "1767225720")
                ]
            ),
            None
        );
        // Delta (Resend's old-draft names; Discord-style decimals).
        let p = ThrottlePolicy {
            ratelimit_reset: Some(ResetUnit::Delta),
            ..policy()
        };
        let h = hdrs(&[("ratelimit-remaining", "0"), ("ratelimit-reset", "2.5")]);
        assert_eq!(
            read(200, &h, at(T0), &p).shift.and_then(|s| s.delay_ms),
            Some(3_000)
        );
        // Unconfigured: the family is ignored, not guessed.
        let p = ThrottlePolicy {
            ratelimit_reset: None,
            ..policy()
        };
        let h = hdrs(&[
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "1767225720"),
        ]);
        assert_eq!(read(200, &h, at(T0), &p).shift, None);
        // A reset in the past means nothing to wait for.
        assert_eq!(
            delay(
                200,
                &[
                    ("x-ratelimit-remaining", "0"),
                    ("x-ratelimit-reset", "1000")
                ]
            ),
            None
        );
    }

    #[test]
    fn date_header_is_the_reference_for_dates() {
        // Server clock says 00:00:00; local clock is 10 s ahead. A date 120 s after the
        // server's Date is still 120 s away.
        let h = hdrs(&[
            ("date", "Thu, 01 Jan 2026 00:00:00 GMT"),
            ("retry-after", "Thu, 01 Jan 2026 00:02:00 GMT"),
        ]);
        let r = read(429, &h, at(T0 + 10), &policy());
        assert_eq!(r.shift.and_then(|s| s.delay_ms), Some(120_000));
        // Without Date, the local receive time is used.
        let h = hdrs(&[("retry-after", "Thu, 01 Jan 2026 00:02:00 GMT")]);
        let r = read(429, &h, at(T0 + 10), &policy());
        assert_eq!(r.shift.and_then(|s| s.delay_ms), Some(110_000));
    }

    #[test]
    fn decimals() {
        assert_eq!(parse_decimal_ms("0"), Some(0));
        assert_eq!(parse_decimal_ms("1.5"), Some(1_500));
        assert_eq!(parse_decimal_ms("0.337"), Some(337));
        assert_eq!(parse_decimal_ms("0.3371"), Some(338));
        assert_eq!(parse_decimal_ms("1767225720.123"), Some(1_767_225_720_123));
        assert_eq!(parse_decimal_ms("-1"), None);
        assert_eq!(parse_decimal_ms("1."), None);
        assert_eq!(parse_decimal_ms(""), None);
        assert_eq!(parse_seconds("18446744073709551616"), Some(u64::MAX));
    }

    /// Random and hostile header values never panic, and every delay is within bounds.
    #[test]
    fn fuzz_never_panics_and_stays_bounded() {
        let mut rng = fastrand::Rng::with_seed(0x51u64);
        let alphabet: &[u8] = b"0123456789.,;=\"-+ \teEinfNaTGMhu:rRtx\\abcdefghijklmnopqrstuvwxyz";
        let names = [
            "retry-after",
            "ratelimit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
            "ratelimit-remaining",
            "ratelimit-reset",
            "date",
        ];
        let seeds = [
            "Thu, 01 Jan 2026 00:02:00 GMT",
            "\"default\";r=0;t=30",
            "99999999999999999999999999",
            "0",
            "1767225720",
        ];
        for round in 0..20_000 {
            let mut h = HeaderMap::new();
            for _ in 0..rng.usize(0..5) {
                let name = names[rng.usize(0..names.len())];
                let value: Vec<u8> = if rng.bool() {
                    let mut s = seeds[rng.usize(0..seeds.len())].as_bytes().to_vec();
                    for _ in 0..rng.usize(0..4) {
                        if !s.is_empty() {
                            let i = rng.usize(0..s.len());
                            s[i] = alphabet[rng.usize(0..alphabet.len())];
                        }
                    }
                    s
                } else {
                    (0..rng.usize(0..40))
                        .map(|_| {
                            if rng.u8(0..10) == 0 {
                                rng.u8(..)
                            } else {
                                alphabet[rng.usize(0..alphabet.len())]
                            }
                        })
                        .collect()
                };
                if let Ok(v) = HeaderValue::from_bytes(&value) {
                    h.append(name, v);
                }
            }
            let status = [200, 429, 503, 500, 302][round % 5];
            let unit = [None, Some(ResetUnit::Delta), Some(ResetUnit::Epoch)][round % 3];
            let p = ThrottlePolicy {
                ratelimit_reset: unit,
                ..policy()
            };
            let r = read(status, &h, at(rng.u64(0..u64::from(u32::MAX) * 4)), &p);
            if let Some(Shift {
                delay_ms: Some(d), ..
            }) = r.shift
            {
                assert!((0..=p.retry_after_max_ms).contains(&d), "{d} for {h:?}");
                if r.throttled {
                    assert!(d >= p.throttle_floor_ms);
                }
            }
            assert_eq!(
                r.throttled,
                status == 429
                    || (status == 503
                        && h.contains_key("retry-after")
                        && r.shift.is_some_and(|s| s.source == Source::RetryAfter))
            );
        }
    }
}
