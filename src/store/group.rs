//! Group commit for single enqueues: concurrent requests share one transaction.
//!
//! One enqueue costs a handful of round trips and a commit (an fsync) while it holds the
//! destination's row lock, so concurrent producers of one destination would otherwise
//! queue behind each other. The [`Enqueuer`] hands requests to a few workers; each takes
//! every request waiting when it becomes free, locks the destinations involved (in id
//! order, like every other multi-destination statement, so it cannot deadlock), admits
//! each job on its own (`Admission::EachJob`), commits once, and only then answers. A
//! request that arrives while the workers are idle is committed at once, alone: grouping
//! adds no latency, it only appears under load. On the embedded store one worker does
//! this, and the commit it saves is SQLite's fsync.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Mutex};

use super::types::{Admitted, EnqueueError};
use super::{Error, Store};
use crate::job::NewJob;

type Reply = oneshot::Sender<Result<Admitted, EnqueueError>>;

/// Jobs of one group, by destination name (the order both stores lock them in).
pub(crate) type Group = BTreeMap<String, Vec<NewJob>>;

/// Per destination of a [`Group`], in its order: each job's own outcome.
pub(crate) type GroupResults = Vec<Vec<Result<Admitted, EnqueueError>>>;

struct Request {
    destination: String,
    job: NewJob,
    reply: Reply,
}

/// Single enqueues, grouped into shared commits. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Enqueuer {
    tx: mpsc::Sender<Request>,
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
        let (tx, rx) = mpsc::channel::<Request>(MAX_GROUP * 4);
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..workers {
            tokio::spawn(work(store.clone(), rx.clone()));
        }
        Enqueuer { tx }
    }

    /// Admits one job, sharing a commit with whatever else is being enqueued.
    pub async fn enqueue(&self, destination: &str, job: NewJob) -> Result<Admitted, EnqueueError> {
        let (reply, answer) = oneshot::channel();
        let request = Request {
            destination: destination.to_owned(),
            job,
            reply,
        };
        if self.tx.send(request).await.is_err() {
            return Err(Error::Database(sqlx::Error::PoolClosed).into());
        }
        answer
            .await
            .unwrap_or_else(|_| Err(Error::Database(sqlx::Error::WorkerCrashed).into()))
    }
}

async fn work(store: Store, rx: Arc<Mutex<mpsc::Receiver<Request>>>) {
    loop {
        let mut group = Vec::with_capacity(MAX_GROUP);
        {
            let mut rx = rx.lock().await;
            match rx.recv().await {
                Some(r) => group.push(r),
                None => return,
            }
            while group.len() < MAX_GROUP {
                match rx.try_recv() {
                    Ok(r) => group.push(r),
                    Err(_) => break,
                }
            }
        }
        commit_group(&store, group).await;
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
