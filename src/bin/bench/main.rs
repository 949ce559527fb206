//! `bench`: Sluice's benchmark suite.
//!
//! ```text
//! cargo run --release --bin bench              # every scenario (under 10 minutes)
//! cargo run --release --bin bench -- --quick   # a smoke run with small sizes
//! cargo run --release --bin bench -- shaping throughput
//! ```
//!
//! Each scenario creates a fresh database on the local PostgreSQL
//! (`SLUICE_BENCH_ADMIN_URL`, default `postgres://postgres@127.0.0.1:5432/postgres`),
//! starts a recording HTTP sink and Sluice (in this process, or as `bench worker`
//! processes), runs, prints a table, and drops the database. Results and the machine
//! they came from are recorded in docs/BENCHMARKS.md.

use std::process::ExitCode;

use clap::Parser;

mod env;
mod scenarios;

#[derive(Debug, Parser)]
#[command(name = "bench", about = "Sluice benchmark suite")]
struct Args {
    /// Small sizes: a smoke run that finishes in about a minute.
    #[arg(long)]
    quick: bool,
    /// Scenarios to run (default: all): shaping, high-rate, throughput, enqueue,
    /// latency, many-destinations, soak, idle, scale-out, embedded. `worker` runs a dispatcher
    /// process for the multi-worker scenarios.
    scenarios: Vec<String>,
}

const ALL: [&str; 10] = [
    "shaping",
    "high-rate",
    "throughput",
    "enqueue",
    "latency",
    "many-destinations",
    "idle",
    "scale-out",
    "embedded",
    "soak",
];

fn main() -> ExitCode {
    let args = Args::parse();
    if std::env::var_os("RUST_LOG").is_some() {
        sluice::telemetry::init();
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        if args.scenarios.first().map(String::as_str) == Some("worker") {
            return scenarios::worker().await;
        }
        let chosen: Vec<String> = if args.scenarios.is_empty() {
            ALL.iter().map(|s| (*s).to_owned()).collect()
        } else {
            args.scenarios.clone()
        };
        println!(
            "# Sluice benchmarks{}\n",
            if args.quick { " (quick)" } else { "" }
        );
        println!("{}\n", scenarios::machine());
        let started = std::time::Instant::now();
        for name in &chosen {
            let t = std::time::Instant::now();
            let out = match name.as_str() {
                "shaping" => scenarios::shaping(args.quick).await,
                "high-rate" => scenarios::high_rate(args.quick).await,
                "throughput" => scenarios::throughput(args.quick).await,
                "enqueue" => scenarios::enqueue(args.quick).await,
                "latency" => scenarios::latency(args.quick).await,
                "many-destinations" => scenarios::many_destinations(args.quick).await,
                "soak" => scenarios::soak(args.quick).await,
                "idle" => scenarios::idle(args.quick).await,
                "scale-out" => scenarios::scale_out(args.quick).await,
                "embedded" => scenarios::embedded(args.quick).await,
                other => Err(anyhow::anyhow!(
                    "unknown scenario {other:?} (one of {ALL:?})"
                )),
            };
            match out {
                Ok(table) => println!("{table}\n_{name}: {:.1} s_\n", t.elapsed().as_secs_f64()),
                Err(e) => {
                    println!("**{name} failed:** {e:#}\n");
                    return Err(e);
                }
            }
        }
        println!("_total: {:.1} s_", started.elapsed().as_secs_f64());
        Ok(())
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
