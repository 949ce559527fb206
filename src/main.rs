//! `sluice` binary: parse the command line, set up logging, hand over to the library.

use std::process::ExitCode;

use clap::Parser as _;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = sluice::cli::Cli::parse();
    // The demo prints its own report; keep the logs to warnings there.
    if matches!(cli.command, sluice::cli::Command::Demo { .. }) {
        sluice::telemetry::init_with_default("warn");
    } else {
        sluice::telemetry::init();
    }
    match sluice::cli::run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sluice: {e:#}");
            ExitCode::FAILURE
        }
    }
}
