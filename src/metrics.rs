//! Process counters and the Prometheus text rendering of `GET /metrics`.
//!
//! Counters are per process (a dispatcher counts what it released); destination gauges
//! come from the database at scrape time, so every process reports the same figures.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::store::DestinationStatus;

/// Counters updated by the dispatcher. Cheap relaxed atomics: they are statistics, not
/// synchronisation.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Jobs released (request started).
    pub released: AtomicU64,
    /// Jobs that succeeded.
    pub succeeded: AtomicU64,
    /// Attempts that failed and were scheduled for a retry.
    pub retried: AtomicU64,
    /// Jobs dead-lettered.
    pub dead: AtomicU64,
    /// Jobs expired at release.
    pub expired: AtomicU64,
    /// Claims returned unreleased (shutdown, late timer, throttle shift).
    pub returned: AtomicU64,
    /// Responses that throttled their job (429, 503 with Retry-After).
    pub throttled: AtomicU64,
    /// Releases abandoned because the timer fired too late to keep the spacing.
    pub late: AtomicU64,
    /// Claim transactions run.
    pub claims: AtomicU64,
    /// Completion transactions run.
    pub completion_batches: AtomicU64,
}

impl Metrics {
    /// Adds one to a counter.
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Renders the Prometheus text exposition format.
    pub fn render(&self, destinations: &[DestinationStatus]) -> String {
        let mut out = String::with_capacity(2_048 + destinations.len() * 512);
        let counters: [(&str, &str, &AtomicU64); 10] = [
            (
                "sluice_throttled_total",
                "Responses that throttled their job.",
                &self.throttled,
            ),
            (
                "sluice_released_total",
                "Jobs released by this process.",
                &self.released,
            ),
            (
                "sluice_succeeded_total",
                "Jobs that got a 2xx.",
                &self.succeeded,
            ),
            (
                "sluice_retried_total",
                "Failed attempts scheduled for retry.",
                &self.retried,
            ),
            ("sluice_dead_total", "Jobs dead-lettered.", &self.dead),
            (
                "sluice_expired_total",
                "Jobs expired at release.",
                &self.expired,
            ),
            (
                "sluice_returned_total",
                "Claims returned to the queue unreleased.",
                &self.returned,
            ),
            (
                "sluice_late_releases_total",
                "Releases abandoned because the timer was too late.",
                &self.late,
            ),
            ("sluice_claims_total", "Claim transactions.", &self.claims),
            (
                "sluice_completion_batches_total",
                "Completion transactions.",
                &self.completion_batches,
            ),
        ];
        for (name, help, c) in counters {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            let _ = writeln!(out, "{name} {}", c.load(Ordering::Relaxed));
        }
        type Field = fn(&DestinationStatus) -> f64;
        let gauges: [(&str, &str, &str, Field); 6] = [
            (
                "sluice_destination_queued",
                "gauge",
                "Jobs waiting for a slot.",
                |d| d.queued as f64,
            ),
            (
                "sluice_destination_in_flight",
                "gauge",
                "Jobs claimed or in flight.",
                |d| f64::from(d.in_flight),
            ),
            (
                "sluice_destination_capacity",
                "gauge",
                "Admission bound.",
                |d| d.capacity as f64,
            ),
            (
                "sluice_destination_delay_seconds",
                "gauge",
                "Time until the next slot.",
                |d| d.delay_ms as f64 / 1_000.0,
            ),
            (
                "sluice_destination_rate_per_second",
                "gauge",
                "Configured rate.",
                |d| 1_000_000.0 / d.interval_us as f64,
            ),
            (
                "sluice_destination_rejected_total",
                "counter",
                "Enqueues rejected because the destination was full.",
                |d| d.rejected_total as f64,
            ),
        ];
        for (name, kind, help, f) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for d in destinations {
                let _ = writeln!(out, "{name}{{destination=\"{}\"}} {}", d.name, f(d));
            }
        }
        out
    }
}
