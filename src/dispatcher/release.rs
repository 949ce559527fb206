//! The release timer: one OS thread that releases claimed jobs at their slots.
//!
//! tokio's timer wheel has 1 ms resolution and fires about a millisecond late, which at
//! 50/s already costs 6% of the rate and at 5,000/s most of it
//! (`../shared/reference/timer-precision.md`). This thread instead sleeps until
//! `spin_margin` before the earliest slot, then spins to it, releasing within a few
//! microseconds. Destinations with long intervals (where a fraction of a millisecond does
//! not matter) skip the spin to save CPU.
//!
//! Two rules keep spacing exact:
//! * Within this process each destination's *actual* releases are run through GCRA again
//!   (with `burst = 1`: never earlier than the previous actual release plus one
//!   interval), so lateness on one release can never shorten the next gap. Targets stay
//!   on the slot grid, so lateness does not accumulate.
//! * A release later than its slot by more than the ticket's `late_limit` is abandoned
//!   (the job goes back to the queue) when the destination is shared with another
//!   dispatcher and this is this process's last pending ticket for it: the next slot may
//!   then belong to the other dispatcher, which will release on time, so a late release
//!   here could land closer than one interval to it. When this process holds the next
//!   slot too, the first rule already pushes that one back; when nobody else claims the
//!   destination, lateness only delays.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// A job waiting for its slot.
#[derive(Debug)]
pub struct Ticket {
    /// The slot, on the local clock.
    pub slot: Instant,
    /// Destination whose spacing applies.
    pub destination_id: i64,
    /// Minimum gap between two releases of the destination.
    pub interval: Duration,
    /// GCRA tolerance, `(burst - 1) * interval`: zero for a pure leaky bucket.
    pub tolerance: Duration,
    /// How late a release may be before it is abandoned.
    pub late_limit: Duration,
    /// Whether to spin for the last stretch (short intervals) or just sleep.
    pub spin: bool,
    /// Whether another dispatcher also claims this destination.
    pub shared: bool,
    /// Where the verdict goes.
    pub reply: oneshot::Sender<Release>,
}

/// The timer's verdict for a ticket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// Go now; the instant is the release time.
    Go(Instant),
    /// The timer fired this much after the slot, beyond the ticket's limit: not released.
    Late(Duration),
    /// Withdrawn before its slot (shutdown or a throttle shift).
    Revoked,
}

enum Command {
    Schedule(Ticket),
    /// Withdraw tickets of a destination whose slot is before `before` (all when `None`).
    Revoke {
        destination_id: Option<i64>,
        before: Option<Instant>,
    },
}

/// Handle to the release thread. Dropping every handle revokes every pending ticket.
#[derive(Debug, Clone)]
pub struct ReleaseTimer {
    tx: mpsc::Sender<Command>,
}

impl ReleaseTimer {
    /// Starts the thread.
    pub fn start(spin_margin: Duration) -> std::io::Result<ReleaseTimer> {
        let (tx, rx) = mpsc::channel();
        thread::Builder::new()
            .name("sluice-release".into())
            .spawn(move || {
                // A preempted release thread makes every later release of a backlogged
                // destination late (strict spacing cannot catch up), so ask the OS to
                // favour it. Needs CAP_SYS_NICE; without it we run at normal priority.
                match thread_priority::set_current_thread_priority(
                    thread_priority::ThreadPriority::Max,
                ) {
                    Ok(()) => tracing::debug!("release thread runs at raised priority"),
                    Err(e) => tracing::info!(error = ?e, "release thread keeps normal priority (no CAP_SYS_NICE)"),
                }
                Worker::new(spin_margin).run(rx)
            })?;
        Ok(ReleaseTimer { tx })
    }

    /// Schedules a ticket. If the thread is gone the ticket's receiver sees a closed
    /// channel, which callers treat like a revocation.
    pub fn schedule(&self, ticket: Ticket) {
        let _ = self.tx.send(Command::Schedule(ticket));
    }

    /// Withdraws a destination's tickets with slots before `before`, and holds it: any
    /// ticket for it scheduled later with a slot before `before` is withdrawn at once
    /// (a claim that raced with a throttle).
    pub fn revoke(&self, destination_id: i64, before: Instant) {
        let _ = self.tx.send(Command::Revoke {
            destination_id: Some(destination_id),
            before: Some(before),
        });
    }

    /// Withdraws every pending ticket.
    pub fn revoke_all(&self) {
        let _ = self.tx.send(Command::Revoke {
            destination_id: None,
            before: None,
        });
    }
}

struct Worker {
    /// Floor of the spin margin (configured).
    spin_margin: Duration,
    /// Recent worst oversleep of the OS timer, decaying; the margin follows it so a
    /// loaded machine gets a longer spin instead of late releases.
    oversleep: Duration,
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
    tickets: HashMap<u64, Ticket>,
    /// Per destination, GCRA's theoretical arrival time computed from actual releases.
    tat: HashMap<i64, Instant>,
    /// Pending tickets per destination.
    pending: HashMap<i64, usize>,
    /// Destinations held by a throttle: no release before the instant.
    holds: HashMap<i64, Instant>,
    seq: u64,
}

impl Worker {
    fn new(spin_margin: Duration) -> Self {
        Worker {
            spin_margin,
            oversleep: Duration::ZERO,
            heap: BinaryHeap::new(),
            tickets: HashMap::new(),
            tat: HashMap::new(),
            pending: HashMap::new(),
            holds: HashMap::new(),
            seq: 0,
        }
    }

    fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            // Take everything already sent, without blocking.
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return self.revoke(None, None),
                }
            }
            let Some(&Reverse((key, id))) = self.heap.peek() else {
                match rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => return,
                }
                continue;
            };
            let Some(ticket) = self.tickets.get(&id) else {
                self.heap.pop(); // revoked
                continue;
            };
            // Never earlier than GCRA allows given this destination's actual releases.
            let target = match self.tat.get(&ticket.destination_id) {
                Some(&tat) => key.max(tat.checked_sub(ticket.tolerance).unwrap_or(tat)),
                None => key,
            };
            if target > key {
                self.heap.pop();
                self.heap.push(Reverse((target, id)));
                continue;
            }
            let wake = if ticket.spin {
                // Spin at most half an interval per release: a release thread spinning
                // flat out takes a core from the work it releases, and on a small
                // machine that costs more rate than the spin wins (docs/BENCHMARKS.md).
                let margin = self.margin().min(ticket.interval / 2);
                target.checked_sub(margin).unwrap_or(target)
            } else {
                target
            };
            let now = Instant::now();
            if now < wake {
                match rx.recv_timeout(wake - now) {
                    Ok(cmd) => self.handle(cmd),
                    Err(RecvTimeoutError::Timeout) => {
                        let over = Instant::now().saturating_duration_since(wake);
                        self.oversleep = over.max(self.oversleep - self.oversleep / 16);
                    }
                    Err(RecvTimeoutError::Disconnected) => return self.revoke(None, None),
                }
                continue;
            }
            while Instant::now() < target {
                std::hint::spin_loop();
            }
            self.heap.pop();
            if let Some(ticket) = self.tickets.remove(&id) {
                self.fire(ticket);
            }
        }
    }

    /// How long before a slot to stop sleeping and start spinning.
    fn margin(&self) -> Duration {
        (self.oversleep * 3 / 2 + Duration::from_micros(50))
            .clamp(self.spin_margin, Duration::from_millis(2))
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Schedule(t) => {
                if self
                    .holds
                    .get(&t.destination_id)
                    .is_some_and(|h| t.slot < *h)
                {
                    let _ = t.reply.send(Release::Revoked);
                    return;
                }
                *self.pending.entry(t.destination_id).or_default() += 1;
                self.seq += 1;
                self.heap.push(Reverse((t.slot, self.seq)));
                self.tickets.insert(self.seq, t);
            }
            Command::Revoke {
                destination_id,
                before,
            } => {
                if let (Some(d), Some(b)) = (destination_id, before) {
                    let now = Instant::now();
                    self.holds.retain(|_, h| *h > now);
                    let h = self.holds.entry(d).or_insert(b);
                    *h = (*h).max(b);
                }
                self.revoke(destination_id, before)
            }
        }
    }

    fn forget(&mut self, destination_id: i64) -> usize {
        match self.pending.get_mut(&destination_id) {
            Some(n) if *n > 1 => {
                *n -= 1;
                *n
            }
            _ => {
                self.pending.remove(&destination_id);
                0
            }
        }
    }

    fn fire(&mut self, ticket: Ticket) {
        let at = Instant::now();
        let late = at.saturating_duration_since(ticket.slot);
        let others = self.forget(ticket.destination_id);
        if late > ticket.late_limit && others == 0 && ticket.shared {
            let _ = ticket.reply.send(Release::Late(late));
            return;
        }
        if ticket.reply.send(Release::Go(at)).is_ok() {
            let tat = self.tat.entry(ticket.destination_id).or_insert(at);
            *tat = (*tat).max(at) + ticket.interval;
        }
        // Forget destinations idle for a while so the map does not grow for ever.
        if self.tat.len() > 50_000 {
            self.tat.retain(|_, t| *t + Duration::from_secs(3_600) > at);
        }
    }

    fn revoke(&mut self, destination_id: Option<i64>, before: Option<Instant>) {
        let ids: Vec<u64> = self
            .tickets
            .iter()
            .filter(|(_, t)| destination_id.is_none_or(|d| d == t.destination_id))
            .filter(|(_, t)| before.is_none_or(|b| t.slot < b))
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            if let Some(t) = self.tickets.remove(&id) {
                self.forget(t.destination_id);
                let _ = t.reply.send(Release::Revoked);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ticket(slot: Instant, dest: i64, interval_us: u64) -> (Ticket, oneshot::Receiver<Release>) {
        let (reply, rx) = oneshot::channel();
        (
            Ticket {
                slot,
                destination_id: dest,
                interval: Duration::from_micros(interval_us),
                tolerance: Duration::ZERO,
                late_limit: Duration::from_millis(50),
                spin: true,
                shared: true,
                reply,
            },
            rx,
        )
    }

    #[tokio::test]
    async fn releases_on_the_grid_and_never_closer_than_the_interval() {
        let timer = ReleaseTimer::start(Duration::from_micros(300)).expect("thread");
        let start = Instant::now() + Duration::from_millis(20);
        let mut rxs = Vec::new();
        // Two tickets deliberately share a slot: the second must wait an interval.
        for slot in [0u64, 5_000, 5_000, 15_000, 20_000] {
            let (t, rx) = ticket(start + Duration::from_micros(slot), 1, 5_000);
            timer.schedule(t);
            rxs.push(rx);
        }
        let mut at = Vec::new();
        for rx in rxs {
            match rx.await.expect("reply") {
                Release::Go(t) => at.push(t),
                other => panic!("{other:?}"),
            }
        }
        for pair in at.windows(2) {
            assert!(
                pair[1] - pair[0] >= Duration::from_micros(5_000),
                "{pair:?}"
            );
        }
        assert!(at[0] >= start);
        // The shared slot pushed the third release to 10 ms; later ones stay on the grid.
        assert!(at[3] - start < Duration::from_micros(15_000 + 2_000));
    }

    #[tokio::test]
    async fn burst_tolerance_lets_b_go_together() {
        let timer = ReleaseTimer::start(Duration::from_micros(300)).expect("thread");
        let start = Instant::now() + Duration::from_millis(5);
        let mut rxs = Vec::new();
        for _ in 0..4 {
            let (mut t, rx) = ticket(start, 7, 10_000);
            t.tolerance = Duration::from_millis(20); // burst 3
            timer.schedule(t);
            rxs.push(rx);
        }
        let mut at = Vec::new();
        for rx in rxs {
            if let Release::Go(t) = rx.await.expect("reply") {
                at.push(t);
            }
        }
        assert!(
            at[2] - at[0] < Duration::from_millis(2),
            "three together: {at:?}"
        );
        assert!(
            at[3] - at[0] >= Duration::from_millis(10),
            "fourth waits: {at:?}"
        );
    }

    #[tokio::test]
    async fn revoke_withdraws_pending_tickets() {
        let timer = ReleaseTimer::start(Duration::from_micros(300)).expect("thread");
        let far = Instant::now() + Duration::from_secs(60);
        let (a, rx_a) = ticket(far, 1, 1_000);
        let (b, rx_b) = ticket(far, 2, 1_000);
        timer.schedule(a);
        timer.schedule(b);
        timer.revoke(1, far + Duration::from_secs(1));
        assert_eq!(rx_a.await.expect("reply"), Release::Revoked);
        timer.revoke_all();
        assert_eq!(rx_b.await.expect("reply"), Release::Revoked);
    }

    #[tokio::test]
    async fn a_hold_withdraws_later_tickets_before_it() {
        let timer = ReleaseTimer::start(Duration::from_micros(300)).expect("thread");
        let now = Instant::now();
        timer.revoke(3, now + Duration::from_secs(10));
        let (early, rx_early) = ticket(now + Duration::from_secs(1), 3, 1_000);
        let (other, rx_other) = ticket(now + Duration::from_millis(5), 4, 1_000);
        timer.schedule(early);
        timer.schedule(other);
        assert_eq!(rx_early.await.expect("reply"), Release::Revoked);
        assert!(
            matches!(rx_other.await.expect("reply"), Release::Go(_)),
            "other destinations unaffected"
        );
    }

    #[tokio::test]
    async fn late_releases_are_abandoned() {
        let timer = ReleaseTimer::start(Duration::from_micros(300)).expect("thread");
        let (reply, rx) = oneshot::channel();
        timer.schedule(Ticket {
            slot: Instant::now() - Duration::from_millis(10),
            destination_id: 1,
            interval: Duration::from_millis(1),
            tolerance: Duration::ZERO,
            late_limit: Duration::from_millis(1),
            spin: false,
            shared: true,
            reply,
        });
        assert!(matches!(rx.await.expect("reply"), Release::Late(_)));
    }
}
