//! One integration binary; a module per area. Every test gets its own database.
//! `timing` tests run serially (see .config/nextest.toml and scripts/test).

mod admission;
mod api;
mod cli;
mod dispatch;
mod harness;
mod throttle;
mod timing;
