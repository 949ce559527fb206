//! Typed configuration: built-in defaults → `config.toml` → environment.
//!
//! Environment overrides: `SLUICE_DATABASE_URL` (falling back to `DATABASE_URL`),
//! `SLUICE_LISTEN`, and any nested key as `SLUICE_<SECTION>__<KEY>`, e.g.
//! `SLUICE_DISPATCHER__LOOKAHEAD_MS=40`. [`Config::validate`] runs once at boot and names
//! the bad key and value.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

use crate::destination::{DestinationConfig, DestinationName, DestinationSpec};

/// The whole configuration. Every field has a default; see `config.toml` for an example.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `postgres://…` for PostgreSQL, or `sqlite:PATH` for the embedded store. Unset:
    /// the embedded store in `sluice.db` in the working directory.
    pub database_url: Option<String>,
    /// Address the HTTP API listens on (loopback by default: expose it deliberately).
    pub listen: SocketAddr,
    /// HTTP API settings.
    pub api: ApiConfig,
    /// Dispatcher tuning.
    pub dispatcher: DispatcherConfig,
    /// Connection pool settings.
    pub database: DatabaseConfig,
    /// Lease rescue, expiry and retention (run by one dispatcher at a time).
    pub maintenance: MaintenanceConfig,
    /// Destinations upserted at start, by name.
    pub destinations: BTreeMap<String, DestinationConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            database_url: None,
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            api: ApiConfig::default(),
            dispatcher: DispatcherConfig::default(),
            database: DatabaseConfig::default(),
            maintenance: MaintenanceConfig::default(),
            destinations: BTreeMap::new(),
        }
    }
}

/// HTTP API settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApiConfig {
    /// Bearer tokens accepted by the API. Empty disables authentication.
    pub tokens: Vec<String>,
    /// Largest request body for single-job endpoints (413 beyond it).
    pub max_body_bytes: usize,
    /// Largest request body for the batch endpoint.
    pub max_batch_bytes: usize,
    /// Most jobs in one batch.
    pub max_batch_jobs: usize,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            tokens: Vec::new(),
            max_body_bytes: 1 << 20,
            max_batch_bytes: 16 << 20,
            max_batch_jobs: 10_000,
        }
    }
}

/// Dispatcher tuning. The defaults are measured (docs/BENCHMARKS.md); change them with care.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DispatcherConfig {
    /// How far ahead a claim takes slots. Longer means fewer database round trips per
    /// job; shorter means a Retry-After or shutdown strands fewer claimed slots.
    pub lookahead_ms: u64,
    /// Fallback poll when no notification arrives (covers lost NOTIFYs).
    pub poll_interval_ms: u64,
    /// Most jobs this dispatcher holds at once (claimed or in flight).
    pub max_concurrency: usize,
    /// Lease beyond `slot + timeout` before a claim is presumed abandoned.
    pub lease_margin_ms: u64,
    /// The release thread wakes this long before a slot and spins to it.
    pub spin_us: u64,
    /// Destinations per claim statement.
    pub claim_destinations: u32,
    /// Jobs per destination per claim statement.
    pub claim_per_destination: u32,
    /// Most outcomes written in one completion transaction.
    pub completion_batch: usize,
    /// On shutdown, how long in-flight requests may take to finish before the process
    /// exits anyway (their jobs are then recovered by lease expiry).
    pub shutdown_grace_ms: u64,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        Self {
            lookahead_ms: 30,
            poll_interval_ms: 2_000,
            max_concurrency: 1_000,
            lease_margin_ms: 30_000,
            spin_us: 500,
            claim_destinations: 512,
            claim_per_destination: 1_000,
            completion_batch: 1_000,
            shutdown_grace_ms: 30_000,
        }
    }
}

/// Housekeeping, run by whichever dispatcher holds the maintenance lock.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MaintenanceConfig {
    /// Whether this process takes part in maintenance.
    pub enabled: bool,
    /// How often the leader rescues expired leases, expires overdue jobs and prunes.
    pub interval_ms: u64,
    /// Finished jobs (succeeded, dead, cancelled, expired) are deleted after this long.
    pub retention_hours: u64,
    /// Rows per pruning or rescue statement (small, so the hot path never waits).
    pub batch: u32,
    /// VACUUM the jobs table after this many rows were pruned (0: leave it to
    /// autovacuum). Without it a table that churns at queue speed keeps growing.
    pub vacuum_after_rows: u64,
}

impl Default for MaintenanceConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            interval_ms: 5_000,
            retention_hours: 168,
            batch: 1_000,
            vacuum_after_rows: 100_000,
        }
    }
}

/// Connection pool settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// Pool size.
    pub max_connections: u32,
    /// How long a request waits for a connection before answering 503.
    pub acquire_timeout_ms: u64,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            max_connections: 16,
            acquire_timeout_ms: 3_000,
        }
    }
}

/// A configuration problem, with the key and value at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file or environment could not be read or has the wrong shape.
    #[error("{0}")]
    Load(#[from] Box<figment::Error>),
    /// A value is out of range or malformed.
    #[error("invalid configuration: {key} = {value}: {message}")]
    Invalid {
        /// Dotted key, e.g. `destinations.sms.capacity`.
        key: String,
        /// The offending value.
        value: String,
        /// What is wrong.
        message: String,
    },
}

fn invalid(
    key: impl Into<String>,
    value: impl ToString,
    message: impl Into<String>,
) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        value: value.to_string(),
        message: message.into(),
    }
}

/// Top-level keys that may come from `SLUICE_*` variables; other `SLUICE_*` variables
/// (say `SLUICE_TEST_DATABASE_URL`) are not configuration and are ignored.
const ENV_KEYS: [&str; 6] = [
    "database_url",
    "listen",
    "api",
    "dispatcher",
    "database",
    "maintenance",
];

impl Config {
    /// Loads defaults, then `path` (required only when `required`), then the environment.
    pub fn load(path: &Path, required: bool) -> Result<Config, ConfigError> {
        if required && !path.exists() {
            return Err(invalid("--config", path.display(), "file not found"));
        }
        let fig = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::file(path))
            .merge(Env::raw().only(&["DATABASE_URL"]))
            .merge(
                Env::prefixed("SLUICE_")
                    .filter(|k| {
                        let k = k.as_str().to_ascii_lowercase();
                        ENV_KEYS
                            .iter()
                            .any(|top| k == *top || k.starts_with(&format!("{top}__")))
                    })
                    .split("__"),
            );
        let config: Config = fig.extract().map_err(Box::new)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges and destination settings. Called by [`Config::load`].
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(url) = &self.database_url {
            if !(url.starts_with("postgres://")
                || url.starts_with("postgresql://")
                || url.starts_with("sqlite:"))
            {
                return Err(invalid(
                    "database_url",
                    redact(url),
                    "must be a postgres:// URL (or sqlite:PATH for the embedded store)",
                ));
            }
        }
        let d = &self.dispatcher;
        range("dispatcher.lookahead_ms", d.lookahead_ms, 1, 10_000)?;
        range(
            "dispatcher.poll_interval_ms",
            d.poll_interval_ms,
            10,
            600_000,
        )?;
        range(
            "dispatcher.max_concurrency",
            d.max_concurrency as u64,
            1,
            100_000,
        )?;
        range(
            "dispatcher.lease_margin_ms",
            d.lease_margin_ms,
            1_000,
            3_600_000,
        )?;
        range("dispatcher.spin_us", d.spin_us, 0, 20_000)?;
        range(
            "dispatcher.claim_destinations",
            u64::from(d.claim_destinations),
            1,
            100_000,
        )?;
        range(
            "dispatcher.claim_per_destination",
            u64::from(d.claim_per_destination),
            1,
            100_000,
        )?;
        range(
            "dispatcher.completion_batch",
            d.completion_batch as u64,
            1,
            100_000,
        )?;
        range(
            "database.max_connections",
            u64::from(self.database.max_connections),
            1,
            1_000,
        )?;
        range(
            "database.acquire_timeout_ms",
            self.database.acquire_timeout_ms,
            10,
            600_000,
        )?;
        range(
            "api.max_body_bytes",
            self.api.max_body_bytes as u64,
            1_024,
            1 << 30,
        )?;
        range(
            "api.max_batch_bytes",
            self.api.max_batch_bytes as u64,
            1_024,
            1 << 31,
        )?;
        range(
            "api.max_batch_jobs",
            self.api.max_batch_jobs as u64,
            1,
            1_000_000,
        )?;
        for (i, t) in self.api.tokens.iter().enumerate() {
            if t.len() < 16 {
                return Err(invalid(
                    format!("api.tokens[{i}]"),
                    "<redacted>",
                    "tokens must be at least 16 characters",
                ));
            }
        }
        self.destination_specs().map(|_| ())
    }

    /// The configured destinations, validated.
    pub fn destination_specs(
        &self,
    ) -> Result<Vec<(DestinationName, DestinationSpec)>, ConfigError> {
        let mut out = Vec::with_capacity(self.destinations.len());
        for (name, cfg) in &self.destinations {
            let parsed = DestinationName::parse(name)
                .map_err(|e| invalid(format!("destinations.{name}"), name, e.to_string()))?;
            let spec = cfg.validate().map_err(|e| {
                invalid(
                    format!("destinations.{name}.{}", e.field),
                    field_value(cfg, &e.field),
                    e.message,
                )
            })?;
            out.push((parsed, spec));
        }
        Ok(out)
    }

    /// Pool acquire timeout as a `Duration`.
    pub fn acquire_timeout(&self) -> Duration {
        Duration::from_millis(self.database.acquire_timeout_ms)
    }
}

fn range(key: &str, v: u64, lo: u64, hi: u64) -> Result<(), ConfigError> {
    if (lo..=hi).contains(&v) {
        Ok(())
    } else {
        Err(invalid(key, v, format!("out of range ({lo} to {hi})")))
    }
}

fn field_value(cfg: &DestinationConfig, field: &str) -> String {
    let v = serde_json::to_value(cfg).unwrap_or_default();
    let top = field.split('[').next().unwrap_or(field);
    v.get(top).map(|x| x.to_string()).unwrap_or_default()
}

/// Hides the password in a database URL for logs and errors.
pub fn redact(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
#[expect(clippy::result_large_err, reason = "figment::Jail's closure signature")]
mod tests {
    use super::*;
    use figment::Jail;

    #[test]
    fn defaults_validate() {
        Config::default().validate().expect("defaults are valid");
    }

    #[test]
    fn file_then_env_layering() {
        Jail::expect_with(|jail| {
            jail.create_file(
                "config.toml",
                r#"
                listen = "127.0.0.1:9999"
                [dispatcher]
                lookahead_ms = 40
                [destinations.sms]
                rate = "10/s"
                capacity = 100
                "#,
            )?;
            jail.set_env("DATABASE_URL", "postgres://fallback/db");
            jail.set_env("SLUICE_DISPATCHER__POLL_INTERVAL_MS", "500");
            jail.set_env("SLUICE_TEST_DATABASE_URL", "ignored");
            let c = Config::load(Path::new("config.toml"), true).expect("loads");
            assert_eq!(c.listen.port(), 9999);
            assert_eq!(c.dispatcher.lookahead_ms, 40);
            assert_eq!(c.dispatcher.poll_interval_ms, 500);
            assert_eq!(c.database_url.as_deref(), Some("postgres://fallback/db"));
            jail.set_env("SLUICE_DATABASE_URL", "postgres://primary/db");
            jail.set_env("SLUICE_LISTEN", "127.0.0.1:7000");
            let c = Config::load(Path::new("config.toml"), true).expect("loads");
            assert_eq!(c.database_url.as_deref(), Some("postgres://primary/db"));
            assert_eq!(c.listen.port(), 7000);
            assert_eq!(c.destination_specs().expect("valid")[0].1.capacity, 100);
            Ok(())
        });
    }

    #[test]
    fn errors_name_key_and_value() {
        Jail::expect_with(|jail| {
            jail.create_file(
                "bad.toml",
                "[destinations.sms]\nrate = \"10/s\"\ncapacity = 0\n",
            )?;
            let e = Config::load(Path::new("bad.toml"), true).expect_err("invalid");
            let msg = e.to_string();
            assert!(
                msg.contains("destinations.sms.capacity") && msg.contains("= 0"),
                "{msg}"
            );

            jail.create_file(
                "rate.toml",
                "[destinations.x]\nrate = \"0/s\"\ncapacity = 5\n",
            )?;
            let msg = Config::load(Path::new("rate.toml"), true)
                .expect_err("bad")
                .to_string();
            assert!(msg.contains("0/s"), "{msg}");

            jail.create_file("typo.toml", "[dispatcher]\nlookahed_ms = 5\n")?;
            let msg = Config::load(Path::new("typo.toml"), true)
                .expect_err("bad")
                .to_string();
            assert!(msg.contains("lookahed_ms"), "{msg}");

            jail.create_file("range.toml", "[dispatcher]\nlookahead_ms = 0\n")?;
            let msg = Config::load(Path::new("range.toml"), true)
                .expect_err("bad")
                .to_string();
            assert!(msg.contains("dispatcher.lookahead_ms = 0"), "{msg}");

            jail.create_file(
                "name.toml",
                "[destinations.\"a b\"]\nrate = \"1/s\"\ncapacity = 5\n",
            )?;
            let msg = Config::load(Path::new("name.toml"), true)
                .expect_err("bad")
                .to_string();
            assert!(msg.contains("a b"), "{msg}");

            jail.set_env("SLUICE_DATABASE_URL", "mysql://x");
            let msg = Config::load(Path::new("missing.toml"), false)
                .expect_err("bad")
                .to_string();
            assert!(msg.contains("database_url"), "{msg}");
            let msg = Config::load(Path::new("missing.toml"), true)
                .expect_err("bad")
                .to_string();
            assert!(msg.contains("not found"), "{msg}");
            Ok(())
        });
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(redact("postgres://u:secret@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("postgres://h/db"), "postgres://h/db");
    }
}
