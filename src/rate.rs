//! Rates and the GCRA slot arithmetic that turns them into release times.
//!
//! Everything here is pure integer arithmetic on microseconds, so it can be tested
//! exhaustively and shared by every store. Two rules hold throughout:
//!
//! * Intervals are rounded **up**: rounding may make Sluice slower than the configured
//!   rate, never faster.
//! * Arithmetic saturates instead of overflowing; a value a user or a downstream controls
//!   can never panic the dispatcher.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Microseconds since the Unix epoch, read from the database clock (DESIGN invariant 6).
pub type Micros = i64;

const US_PER_MS: u128 = 1_000;
const US_PER_S: u128 = 1_000_000;

/// The largest interval we accept: about 31 years, comfortably inside `i64` microseconds
/// and inside what PostgreSQL's `bigint` arithmetic on timestamps can carry.
pub const MAX_INTERVAL_US: i64 = 1_000_000_000_000_000;

/// A sustained limit such as `50/s`, `600/min`, `1/5s` or `3/250ms`.
///
/// The parsed form keeps the text as written (for display and round trips) and the
/// interval between two releases in whole microseconds, rounded up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rate {
    text: String,
    interval_us: i64,
}

/// Why a rate string was rejected. The message is shown to users verbatim.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid rate {input:?}: {reason} (expected N/unit or N/<duration>, e.g. 50/s, 600/min, 1/5s, 3/250ms)")]
pub struct RateError {
    input: String,
    reason: &'static str,
}

impl Rate {
    /// Microseconds between two releases (`1/rate`, rounded up).
    pub fn interval_us(&self) -> i64 {
        self.interval_us
    }

    /// Releases per second, for display.
    pub fn per_second(&self) -> f64 {
        1_000_000.0 / self.interval_us as f64
    }

    /// The rate exactly as written in config or the API.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl FromStr for Rate {
    type Err = RateError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = |reason| RateError {
            input: input.to_owned(),
            reason,
        };
        let text = input.trim();
        let (count, per) = text.split_once('/').ok_or_else(|| err("missing '/'"))?;
        let (numerator, scale) = parse_count(count.trim()).map_err(err)?;
        let per_us = parse_period_us(per.trim()).map_err(err)?;
        // interval = per_us / (numerator / scale) = per_us * scale / numerator, rounded up.
        let scaled = per_us
            .checked_mul(scale)
            .ok_or_else(|| err("period is too long"))?;
        let interval = scaled.div_ceil(numerator);
        if interval > MAX_INTERVAL_US as u128 {
            return Err(err("interval is too long (more than 31 years)"));
        }
        Ok(Rate {
            text: text.to_owned(),
            // Rates faster than 1/µs round up to 1 µs: slower than asked, never faster.
            interval_us: interval.max(1) as i64,
        })
    }
}

impl Serialize for Rate {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for Rate {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Parses the count of `N/unit` as a decimal with at most 6 fractional digits, returning
/// `(numerator, scale)` with `N = numerator / scale`. `0.2/s` is how people write one
/// release every five seconds, so fractions are allowed; zero and negatives are not.
fn parse_count(s: &str) -> Result<(u128, u128), &'static str> {
    if s.is_empty() {
        return Err("missing count before '/'");
    }
    let (int_part, frac_part) = match s.split_once('.') {
        Some((i, f)) => (i, f),
        None => (s, ""),
    };
    if s.starts_with('-') {
        return Err("count must be positive");
    }
    let digits_ok = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
    if !digits_ok(int_part)
        || !digits_ok(frac_part)
        || (int_part.is_empty() && frac_part.is_empty())
    {
        return Err("count is not a number");
    }
    if frac_part.len() > 6 {
        return Err("count has more than 6 decimal places");
    }
    if int_part.len() > 18 {
        return Err("count is too large");
    }
    let scale = 10u128.pow(frac_part.len() as u32);
    let int: u128 = if int_part.is_empty() {
        0
    } else {
        int_part.parse().map_err(|_| "count is not a number")?
    };
    let frac: u128 = if frac_part.is_empty() {
        0
    } else {
        frac_part.parse().map_err(|_| "count is not a number")?
    };
    let numerator = int * scale + frac;
    if numerator == 0 {
        return Err("count must be greater than zero");
    }
    Ok((numerator, scale))
}

/// Parses the period after the slash: a bare unit (`s`, `min`, `h`, `day`) or a duration
/// with a positive integer amount (`5s`, `250ms`, `2h`).
fn parse_period_us(s: &str) -> Result<u128, &'static str> {
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (amount, unit) = s.split_at(split);
    let unit_us = unit_us(unit.trim()).ok_or("unknown unit (use us, ms, s, min, h or day)")?;
    let amount: u128 = if amount.is_empty() {
        1
    } else {
        if amount.len() > 18 {
            return Err("period is too long");
        }
        amount.parse().map_err(|_| "period is not a number")?
    };
    if amount == 0 {
        return Err("period must be greater than zero");
    }
    amount.checked_mul(unit_us).ok_or("period is too long")
}

fn unit_us(unit: &str) -> Option<u128> {
    Some(match unit {
        "us" | "µs" => 1,
        "ms" => US_PER_MS,
        "s" | "sec" | "second" => US_PER_S,
        "m" | "min" | "minute" => 60 * US_PER_S,
        "h" | "hour" => 3_600 * US_PER_S,
        "d" | "day" => 86_400 * US_PER_S,
        _ => return None,
    })
}

/// GCRA ("virtual scheduling") for one destination: `interval` between releases and a
/// tolerance of `burst - 1` intervals. `tat` is the theoretical arrival time, which the
/// database stores as the destination's `next_slot`.
///
/// With `burst = 1` this is a pure leaky bucket: releases are never closer than one
/// interval, and an idle destination earns no credit (`max(now, tat)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    /// Microseconds between releases at the sustained rate.
    pub interval_us: i64,
    /// Releases allowed back to back after idleness (`>= 1`).
    pub burst: u32,
}

/// One release decided by [`Gcra::assign`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Assigned {
    /// When the job may be released.
    pub slot: Micros,
    /// The destination's `next_slot` after this release.
    pub next_tat: Micros,
}

impl Gcra {
    /// How far before `tat` a release may happen: `(burst - 1) * interval`.
    pub fn tolerance_us(&self) -> i64 {
        i64::from(self.burst.saturating_sub(1)).saturating_mul(self.interval_us)
    }

    /// The earliest instant at or after `now` at which a job could be released.
    pub fn earliest(&self, tat: Micros, now: Micros) -> Micros {
        now.max(tat.saturating_sub(self.tolerance_us()))
    }

    /// Assigns the next release for a job that may not go before `ready_at`.
    ///
    /// GCRA: a release at `t` conforms when `t >= tat - tolerance`; afterwards
    /// `tat = max(tat, t) + interval`. `t` is never before `now`, so the past cannot be
    /// spent as credit beyond the configured burst.
    pub fn assign(&self, tat: Micros, now: Micros, ready_at: Micros) -> Assigned {
        let slot = self.earliest(tat, now).max(ready_at);
        Assigned {
            slot,
            next_tat: tat.max(slot).saturating_add(self.interval_us),
        }
    }

    /// Estimated microseconds from `now` until `jobs` more releases have happened, given
    /// the current `tat`. Used for the Retry-After of a rejected enqueue: room frees up as
    /// the backlog drains at the destination's rate.
    pub fn drain_time_us(&self, tat: Micros, now: Micros, jobs: u64) -> i64 {
        if jobs == 0 {
            return 0;
        }
        let first = self.earliest(tat, now).saturating_sub(now);
        let rest = i64::try_from(jobs - 1)
            .unwrap_or(i64::MAX)
            .saturating_mul(self.interval_us);
        first.saturating_add(rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn interval(s: &str) -> i64 {
        s.parse::<Rate>()
            .unwrap_or_else(|e| panic!("{s}: {e}"))
            .interval_us()
    }

    fn reject(s: &str) -> String {
        match s.parse::<Rate>() {
            Ok(r) => panic!("{s} parsed as {} us", r.interval_us()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn named_units() {
        assert_eq!(interval("50/s"), 20_000);
        assert_eq!(interval("1/s"), 1_000_000);
        assert_eq!(interval("600/min"), 100_000);
        assert_eq!(interval("60/m"), 1_000_000);
        assert_eq!(interval("3600/h"), 1_000_000);
        assert_eq!(interval("1/h"), 3_600_000_000);
        assert_eq!(interval("10000/day"), 8_640_000);
        assert_eq!(interval("1/d"), 86_400_000_000);
        assert_eq!(interval("1000/sec"), 1_000);
        assert_eq!(interval("2/second"), 500_000);
        assert_eq!(interval("2/minute"), 30_000_000);
        assert_eq!(interval("2/hour"), 1_800_000_000);
    }

    #[test]
    fn durations() {
        assert_eq!(interval("1/5s"), 5_000_000);
        assert_eq!(interval("3/250ms"), 83_334);
        assert_eq!(interval("1/100us"), 100);
        assert_eq!(interval("10/2h"), 720_000_000);
        assert_eq!(interval("1/30min"), 1_800_000_000);
        assert_eq!(interval("7/1d"), 12_342_857_143);
    }

    #[test]
    fn rounds_up_never_down() {
        assert_eq!(interval("3/s"), 333_334);
        assert_eq!(interval("7/s"), 142_858);
        assert_eq!(interval("9/s"), 111_112);
        // Exact divisions are not bumped.
        assert_eq!(interval("4/s"), 250_000);
        // Faster than one per microsecond is clamped to 1 µs (slower than asked).
        assert_eq!(interval("2000000/s"), 1);
        // Property: interval * count >= period for every count in a range.
        for n in 1..5_000u64 {
            let i = interval(&format!("{n}/s"));
            assert!(i as u64 * n >= 1_000_000, "{n}/s -> {i}");
            assert!(
                (i as u64 - 1) * n < 1_000_000,
                "{n}/s -> {i} is not the smallest"
            );
        }
    }

    #[test]
    fn fractional_counts() {
        assert_eq!(interval("0.2/s"), 5_000_000);
        assert_eq!(interval("2.5/s"), 400_000);
        assert_eq!(interval(".5/s"), 2_000_000);
        assert_eq!(interval("0.000001/s"), 1_000_000_000_000);
        assert_eq!(interval("1.5/min"), 40_000_000);
    }

    #[test]
    fn whitespace_and_text_round_trip() {
        let r: Rate = " 50 / s ".parse().expect("parses");
        assert_eq!(r.interval_us(), 20_000);
        assert_eq!(r.to_string(), "50 / s");
        assert!((r.per_second() - 50.0).abs() < 1e-9);
    }

    #[test]
    fn rejects_bad_input_with_a_reason() {
        assert!(reject("0/s").contains("greater than zero"));
        assert!(reject("0.0/s").contains("greater than zero"));
        assert!(reject("-5/s").contains("positive"));
        assert!(reject("abc/s").contains("not a number"));
        assert!(reject("5").contains("missing '/'"));
        assert!(reject("/s").contains("missing count"));
        assert!(reject("5/").contains("unknown unit"));
        assert!(reject("5/fortnight").contains("unknown unit"));
        assert!(reject("5/0s").contains("greater than zero"));
        assert!(reject("5/-1s").contains("unknown unit"));
        assert!(reject("1e3/s").contains("not a number"));
        assert!(reject("inf/s").contains("not a number"));
        assert!(reject("NaN/s").contains("not a number"));
        assert!(reject("+5/s").contains("not a number"));
        assert!(reject("1.2345678/s").contains("decimal places"));
        assert!(reject("5/s/s").contains("unknown unit"));
        assert!(reject("").contains("missing '/'"));
        assert!(reject(".").contains("missing '/'"));
        assert!(reject("./s").contains("not a number"));
    }

    #[test]
    fn rejects_overflow() {
        assert!(reject("99999999999999999999999/s").contains("too large"));
        assert!(reject("1/99999999999999999999d").contains("too long"));
        assert!(reject("1/999999999999999999d").contains("too long"));
        assert!(reject("0.000001/day").contains("31 years"));
        // The largest accepted interval still fits i64 with room for slot arithmetic.
        assert_eq!(interval("1/11574d"), 999_993_600_000_000);
    }

    #[test]
    fn serde_round_trip() {
        let r: Rate = serde_json::from_str("\"600/min\"").expect("parses");
        assert_eq!(r.interval_us(), 100_000);
        assert_eq!(
            serde_json::to_string(&r).expect("serializes"),
            "\"600/min\""
        );
        let err = serde_json::from_str::<Rate>("\"0/s\"").expect_err("rejected");
        assert!(err.to_string().contains("greater than zero"));
    }

    const T: i64 = 20_000;

    fn leaky() -> Gcra {
        Gcra {
            interval_us: T,
            burst: 1,
        }
    }

    /// Releases `n` jobs as early as GCRA allows, all ready at `now`.
    fn release_all(g: Gcra, mut tat: Micros, now: Micros, n: usize) -> (Vec<Micros>, Micros) {
        let mut slots = Vec::new();
        for _ in 0..n {
            let a = g.assign(tat, now, now);
            slots.push(a.slot);
            tat = a.next_tat;
        }
        (slots, tat)
    }

    #[test]
    fn leaky_bucket_spaces_by_interval() {
        let (slots, tat) = release_all(leaky(), 0, 1_000_000, 5);
        assert_eq!(
            slots,
            vec![1_000_000, 1_020_000, 1_040_000, 1_060_000, 1_080_000]
        );
        assert_eq!(tat, 1_100_000);
    }

    #[test]
    fn no_idle_credit() {
        // The destination last released long ago; the next goes now, then an interval later.
        let g = leaky();
        let a = g.assign(5_000, 10_000_000, 10_000_000);
        assert_eq!(a.slot, 10_000_000);
        let b = g.assign(a.next_tat, 10_000_000, 10_000_000);
        assert_eq!(b.slot, 10_000_000 + T);
    }

    #[test]
    fn future_tat_is_honoured() {
        let g = leaky();
        let a = g.assign(2_000_000, 1_000_000, 1_000_000);
        assert_eq!(a.slot, 2_000_000);
        assert_eq!(a.next_tat, 2_000_000 + T);
    }

    #[test]
    fn ready_at_delays_the_slot_and_the_sequence() {
        let g = leaky();
        let a = g.assign(1_000_000, 1_000_000, 1_500_000);
        assert_eq!(a.slot, 1_500_000);
        assert_eq!(a.next_tat, 1_500_000 + T);
    }

    #[test]
    fn burst_allows_exactly_b_back_to_back() {
        let g = Gcra {
            interval_us: T,
            burst: 5,
        };
        let now = 1_000_000;
        let (slots, _) = release_all(g, 0, now, 8);
        assert_eq!(&slots[..5], &[now; 5]);
        assert_eq!(slots[5], now + T);
        assert_eq!(slots[6], now + 2 * T);
        assert_eq!(slots[7], now + 3 * T);
    }

    /// Invariant 2 checked by brute force: in any window of length W, releases
    /// <= ceil(W / T) + burst - 1 (+1 for an inclusive window).
    #[test]
    fn window_bound_holds_for_bursts_and_idle_gaps() {
        for burst in 1..=6u32 {
            let g = Gcra {
                interval_us: T,
                burst,
            };
            let mut tat = 0;
            let mut now = 0;
            let mut releases = Vec::new();
            // A mix of backlogged runs and idle gaps.
            for round in 0..20i64 {
                let n = (round % 7 + 1) as usize;
                let (slots, t) = release_all(g, tat, now, n);
                releases.extend(slots);
                tat = t;
                now = tat + (round % 3) * 3 * T;
            }
            for w in [T / 2, T, 3 * T, 10 * T + 1] {
                let bound = (w as u64).div_ceil(T as u64) as usize + burst as usize - 1 + 1;
                for (i, start) in releases.iter().enumerate() {
                    let inside = releases[i..].iter().filter(|&&r| r <= start + w).count();
                    assert!(
                        inside <= bound,
                        "burst {burst} window {w}: {inside} > {bound}"
                    );
                }
            }
            if burst == 1 {
                for pair in releases.windows(2) {
                    assert!(pair[1] - pair[0] >= T, "gap {pair:?}");
                }
            }
        }
    }

    #[test]
    fn arithmetic_saturates() {
        let g = Gcra {
            interval_us: MAX_INTERVAL_US,
            burst: u32::MAX,
        };
        let a = g.assign(i64::MAX, i64::MAX, i64::MAX);
        assert_eq!(a.slot, i64::MAX);
        assert_eq!(a.next_tat, i64::MAX);
        assert_eq!(g.earliest(i64::MIN, 0), 0);
        assert_eq!(g.drain_time_us(i64::MAX, 0, u64::MAX), i64::MAX);
    }

    #[test]
    fn drain_time_estimates_rejections() {
        let g = leaky();
        assert_eq!(g.drain_time_us(0, 1_000, 0), 0);
        // Idle destination: the first job goes now, the 10th nine intervals later.
        assert_eq!(g.drain_time_us(0, 1_000, 10), 9 * T);
        // Backlogged: wait for next_slot first.
        assert_eq!(g.drain_time_us(1_000 + 500_000, 1_000, 1), 500_000);
    }
}
