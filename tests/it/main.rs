//! One integration binary; a module per area. Every test gets its own database.

mod admission;
mod api;
mod cli;
mod harness;
