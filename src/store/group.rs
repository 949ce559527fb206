//! Group commit for single enqueues: concurrent requests share one transaction.
//!
//! One enqueue costs a handful of round trips and a commit (an fsync) while it holds the
//! destination's row lock, so concurrent producers of one destination would otherwise
//! queue behind each other. The [`Enqueuer`] hands each request to one of a few workers,
//! chosen by its destination, so one destination's requests always meet in the same
//! worker and two workers never wait for each other's row locks. A worker takes every
//! request waiting when it becomes free, locks the destinations involved (in id order,
//! like every other multi-destination statement, so it cannot deadlock), admits each job
//! on its own (`Admission::EachJob`), commits once, and only then answers. A request that
//! arrives while its worker is idle is committed at once, alone: grouping adds no latency,
//! it only appears under load. On the embedded store one worker does this, and the commit
//! it saves is SQLite's fsync.

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use tokio::sync::{mpsc, oneshot};

use super::types::{Admitted, EnqueueError};
use super::{Error, Store};
use crate::job::NewJob;

type Reply = oneshot::Sender<Result<Admitted, EnqueueError>>;

/// Jobs of one group, by destination name (the order both stores lock them in).
pub(crate) type Group = BTreeMap<String, Vec<NewJob>>;

/// Per destination of a [`Group`], in its order: each job's own outcome.
pub(crate) type GroupResults = Vec<Vec<Result<Admitted, EnqueueError>>>;

/// The results for a group's jobs to a destination that does not exist: each request
/// fails on its own, the rest of the group is still admitted.
pub(crate) fn unknown_destination(
    name: &str,
    jobs: &[NewJob],
) -> Vec<Result<Admitted, EnqueueError>> {
    jobs.iter()
        .map(|_| Err(Error::UnknownDestination(name.to_owned()).into()))
        .collect()
}

struct Request {
    destination: String,
    job: NewJob,
    reply: Reply,
}

/// Single enqueues, grouped into shared commits. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Enqueuer {
    /// One queue per worker; a destination always maps to the same one.
    shards: Vec<mpsc::Sender<Request>>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("destination", &self.destination)
            .finish()
    }
}

/// Requests per shared transaction, at most.
const MAX_GROUP: usize = 512;

impl Enqueuer {
    /// Starts `workers` grouping workers on the current runtime (one on the embedded
    /// store, which has one writer connection). They stop when every clone of the
    /// returned handle is dropped.
    pub fn start(store: Store, workers: usize) -> Enqueuer {
        let workers = if store.is_embedded() {
            1
        } else {
            workers.max(1)
        };
        let shards = (0..workers)
            .map(|_| {
                let (tx, rx) = mpsc::channel::<Request>(MAX_GROUP * 4);
                tokio::spawn(work(store.clone(), rx));
                tx
            })
            .collect();
        Enqueuer { shards }
    }

    /// Admits one job, sharing a commit with whatever else is being enqueued.
    pub async fn enqueue(&self, destination: &str, job: NewJob) -> Result<Admitted, EnqueueError> {
        let (reply, answer) = oneshot::channel();
        let request = Request {
            destination: destination.to_owned(),
            job,
            reply,
        };
        let mut hash = DefaultHasher::new();
        destination.hash(&mut hash);
        let shard = &self.shards[(hash.finish() % self.shards.len() as u64) as usize];
        if shard.send(request).await.is_err() {
            return Err(Error::Database(sqlx::Error::PoolClosed).into());
        }
        answer
            .await
            .unwrap_or_else(|_| Err(Error::Database(sqlx::Error::WorkerCrashed).into()))
    }
}

async fn work(store: Store, mut rx: mpsc::Receiver<Request>) {
    let mut group = Vec::with_capacity(MAX_GROUP);
    while rx.recv_many(&mut group, MAX_GROUP).await > 0 {
        commit_group(&store, std::mem::take(&mut group)).await;
    }
}

async fn commit_group(store: &Store, group: Vec<Request>) {
    let mut jobs: Group = BTreeMap::new();
    let mut replies: BTreeMap<String, Vec<Reply>> = BTreeMap::new();
    for r in group {
        jobs.entry(r.destination.clone()).or_default().push(r.job);
        replies.entry(r.destination).or_default().push(r.reply);
    }
    match store.admit_group(&jobs).await {
        Ok(results) => {
            for (replies, results) in replies.into_values().zip(results) {
                for (reply, result) in replies.into_iter().zip(results) {
                    let _ = reply.send(result);
                }
            }
        }
        Err(e) => {
            // Nothing was committed; every request in the group fails alike.
            let unavailable = matches!(&e, EnqueueError::Store(s) if s.is_unavailable());
            if !unavailable {
                tracing::error!(error = %e, "grouped enqueue failed");
            }
            for reply in replies.into_values().flatten() {
                let err = if unavailable {
                    Error::Database(sqlx::Error::PoolTimedOut)
                } else {
                    Error::Database(sqlx::Error::Protocol(e.to_string()))
                };
                let _ = reply.send(Err(err.into()));
            }
        }
    }
}
