//! One integration binary; a module per area. Every test gets its own database.
//! `timing` and `crash` tests run serially (see .config/nextest.toml and scripts/test).

mod admission;
mod api;
mod cli;
mod crash;
mod dispatch;
mod embedded;
mod harness;
mod recovery;
mod throttle;
mod timing;
