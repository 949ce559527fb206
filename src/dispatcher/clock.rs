//! Maps database-clock microseconds to local `Instant`s.
//!
//! Slots come from the database clock (one clock for all dispatchers); timers run on the
//! local monotonic clock. The mapping is taken from the probe with the smallest round
//! trip, so its error is at most half that round trip (tens of microseconds on a LAN),
//! and refreshed periodically to absorb drift.

use std::time::{Duration, Instant};

use crate::rate::Micros;
use crate::store::{self, Store};

/// A database-clock ↔ `Instant` correspondence.
#[derive(Debug, Clone, Copy)]
pub struct DbClock {
    base: Instant,
    base_us: Micros,
    /// Round trip of the probe the mapping came from (its error bound is half of it).
    pub rtt: Duration,
    /// When the mapping was taken.
    pub taken: Instant,
}

impl DbClock {
    /// Probes the database clock a few times and keeps the tightest sample.
    pub async fn sync(store: &Store) -> store::Result<DbClock> {
        let mut best: Option<DbClock> = None;
        for _ in 0..5 {
            let sent = Instant::now();
            let us = store.now_us().await?;
            let received = Instant::now();
            let rtt = received - sent;
            if best.is_none_or(|b| rtt < b.rtt) {
                best = Some(DbClock {
                    base: sent + rtt / 2,
                    base_us: us,
                    rtt,
                    taken: received,
                });
            }
        }
        Ok(best.unwrap_or_else(|| DbClock::local(Instant::now(), 0)))
    }

    /// A mapping from a known pair (tests, embedded stores whose clock is local).
    pub fn local(base: Instant, base_us: Micros) -> DbClock {
        DbClock {
            base,
            base_us,
            rtt: Duration::ZERO,
            taken: base,
        }
    }

    /// The local instant corresponding to database time `us`.
    pub fn instant_at(&self, us: Micros) -> Instant {
        let delta = us.saturating_sub(self.base_us);
        let d = Duration::from_micros(delta.unsigned_abs());
        if delta >= 0 {
            self.base.checked_add(d).unwrap_or(self.base)
        } else {
            self.base.checked_sub(d).unwrap_or(self.base)
        }
    }

    /// The database time corresponding to local instant `at`.
    pub fn us_at(&self, at: Instant) -> Micros {
        if at >= self.base {
            self.base_us
                .saturating_add(i64::try_from((at - self.base).as_micros()).unwrap_or(i64::MAX))
        } else {
            self.base_us
                .saturating_sub(i64::try_from((self.base - at).as_micros()).unwrap_or(i64::MAX))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_both_ways() {
        let base = Instant::now();
        let c = DbClock::local(base, 1_000_000);
        assert_eq!(c.instant_at(1_000_000), base);
        assert_eq!(
            c.instant_at(1_250_000),
            base + Duration::from_micros(250_000)
        );
        assert_eq!(c.us_at(base + Duration::from_micros(7)), 1_000_007);
        assert_eq!(c.us_at(c.instant_at(900_000)), 900_000);
        // Absurd values saturate instead of panicking.
        let _ = c.instant_at(i64::MAX);
        let _ = c.instant_at(i64::MIN);
    }
}
