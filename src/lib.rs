//! Sluice: a rate-shaping job dispatcher.
//!
//! Producers enqueue HTTP jobs for named *destinations*; jobs are persisted in
//! PostgreSQL; dispatchers claim them and release each one at its destination's
//! leaky-bucket rate, strictly spaced, across any number of processes.
//!
//! # Architecture tour
//!
//! | module | job |
//! |---|---|
//! | [`rate`] | `Rate` parsing and GCRA slot arithmetic: pure integer microseconds |
//! | [`destination`], [`job`] | what users submit, validated |
//! | [`store`] | the only place SQL lives: admission, claim, completion |
//! | [`dispatcher`] | claim loop, precise release thread, delivery tasks, batched completions |
//! | [`delivery`] | one shared reqwest client; bounded response reads |
//! | [`throttle`] | reading Retry-After / RateLimit / X-RateLimit: pure, fuzzed |
//! | [`api`] | axum routes, JSON errors, bearer auth |
//! | [`maintenance`] | lease rescue, expiry, retention: one leader via an advisory lock |
//! | [`app`] | process wiring for `serve` / `worker` |
//! | [`config`] | defaults → `config.toml` → environment, validated at boot |
//! | [`cli`] | the `sluice` command |
//! | [`demo`] | `sluice demo`: leaky vs bursty, side by side |
//!
//! Data flow: `POST /v1/destinations/{name}/jobs` → [`store::Store::enqueue`] (capacity
//! checked under the destination row lock) → `NOTIFY` → [`dispatcher::Dispatcher`] claims
//! slots within a short lookahead → the release thread lets each job go at its slot →
//! [`delivery::Deliverer::send`] → outcome recorded in a batch.
//!
//! # Embedding
//!
//! Enqueue inside your own transaction with [`store::enqueue_in`]: the job exists only if
//! your business change commits. Run a dispatcher in-process with
//! [`dispatcher::Dispatcher::run`].

pub mod api;
pub mod app;
pub mod cli;
pub mod config;
pub mod delivery;
pub mod demo;
pub mod destination;
pub mod dispatcher;
pub mod job;
pub mod maintenance;
pub mod metrics;
pub mod rate;
pub mod shutdown;
pub mod store;
pub mod telemetry;
pub mod throttle;
pub mod timestamp;
