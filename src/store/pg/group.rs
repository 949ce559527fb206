//! Group commit for single enqueues: concurrent requests share one transaction.
//!
//! One enqueue costs a handful of round trips and a commit (an fsync) while it holds the
//! destination's row lock, so concurrent producers of one destination would otherwise
//! queue behind each other. The [`Enqueuer`] hands requests to a few workers; each takes
//! every request waiting when it becomes free, locks the destinations involved (in id
//! order, like every other multi-destination statement, so it cannot deadlock), admits
//! each job on its own (`Admission::EachJob`), commits once, and only then answers. A
//! request that arrives while the workers are idle is committed at once, alone: grouping
//! adds no latency, it only appears under load.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Mutex};

use super::enqueue::admit;
use super::Pg;
use crate::job::NewJob;
use crate::store::types::{Admission, Admitted, EnqueueError};
use crate::store::{Backend, Error, Store};

type Reply = oneshot::Sender<Result<Admitted, EnqueueError>>;

struct Request {
    destination: String,
    job: NewJob,
    reply: Reply,
}

/// Single enqueues, grouped into shared commits on PostgreSQL. Cheap to clone. (The
/// embedded store has one writer connection, so there it enqueues directly.)
#[derive(Clone, Debug)]
pub struct Enqueuer {
    inner: Inner,
}

#[derive(Clone, Debug)]
enum Inner {
    Grouped(mpsc::Sender<Request>),
    Direct(Store),
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
    /// Starts `workers` grouping workers on the current runtime. They stop when every
    /// clone of the returned handle is dropped.
    pub fn start(store: Store, workers: usize) -> Enqueuer {
        let Backend::Postgres(pg) = &store.backend else {
            return Enqueuer {
                inner: Inner::Direct(store),
            };
        };
        let (tx, rx) = mpsc::channel::<Request>(MAX_GROUP * 4);
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..workers.max(1) {
            tokio::spawn(work(pg.clone(), rx.clone()));
        }
        Enqueuer {
            inner: Inner::Grouped(tx),
        }
    }

    /// Admits one job, sharing a commit with whatever else is being enqueued.
    pub async fn enqueue(&self, destination: &str, job: NewJob) -> Result<Admitted, EnqueueError> {
        let tx = match &self.inner {
            Inner::Grouped(tx) => tx,
            Inner::Direct(store) => {
                let admitted = store
                    .enqueue(destination, std::slice::from_ref(&job))
                    .await?;
                return admitted
                    .into_iter()
                    .next()
                    .ok_or_else(|| Error::Database(sqlx::Error::RowNotFound).into());
            }
        };
        let (reply, answer) = oneshot::channel();
        let request = Request {
            destination: destination.to_owned(),
            job,
            reply,
        };
        if tx.send(request).await.is_err() {
            return Err(Error::Database(sqlx::Error::PoolClosed).into());
        }
        answer
            .await
            .unwrap_or_else(|_| Err(Error::Database(sqlx::Error::WorkerCrashed).into()))
    }
}

async fn work(store: Pg, rx: Arc<Mutex<mpsc::Receiver<Request>>>) {
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

async fn commit_group(store: &Pg, group: Vec<Request>) {
    let mut by_destination: BTreeMap<String, (Vec<NewJob>, Vec<Reply>)> = BTreeMap::new();
    for r in group {
        let e = by_destination.entry(r.destination).or_default();
        e.0.push(r.job);
        e.1.push(r.reply);
    }
    let outcome = async {
        let mut tx = store.pool.begin().await?;
        let names: Vec<&str> = by_destination.keys().map(String::as_str).collect();
        sqlx::query(
            "SELECT 1 FROM sluice_destinations WHERE name = ANY($1) ORDER BY id FOR UPDATE",
        )
        .bind(&names)
        .execute(&mut *tx)
        .await?;
        let mut results = Vec::with_capacity(by_destination.len());
        for (name, (jobs, _)) in &by_destination {
            match admit(&mut tx, name, jobs, Admission::EachJob).await {
                Ok(r) => results.push(r),
                Err(EnqueueError::Store(Error::UnknownDestination(n))) => results.push(
                    jobs.iter()
                        .map(|_| Err(Error::UnknownDestination(n.clone()).into()))
                        .collect(),
                ),
                Err(e) => return Err(e),
            }
        }
        tx.commit().await?;
        Ok::<_, EnqueueError>(results)
    };
    match outcome.await {
        Ok(results) => {
            for ((_, (_, replies)), results) in by_destination.into_iter().zip(results) {
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
            for (_, (_, replies)) in by_destination {
                for reply in replies {
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
}
