-- Sluice's embedded schema: the same tables and columns as the PostgreSQL schema, in
-- SQLite's types. Instants are integer microseconds since the Unix epoch; booleans are
-- 0/1; arrays and headers are JSON text; ids are 16-byte UUIDv7 blobs.

CREATE TABLE sluice_destinations (
    id                       INTEGER PRIMARY KEY AUTOINCREMENT,
    name                     TEXT    NOT NULL UNIQUE,
    rate                     TEXT    NOT NULL,
    interval_us              INTEGER NOT NULL CHECK (interval_us > 0),
    burst                    INTEGER NOT NULL DEFAULT 1 CHECK (burst >= 1),
    capacity                 INTEGER NOT NULL CHECK (capacity >= 1),
    max_in_flight            INTEGER CHECK (max_in_flight >= 1),
    allowed_base_urls        TEXT    NOT NULL DEFAULT '[]',
    timeout_ms               INTEGER NOT NULL CHECK (timeout_ms > 0),
    max_attempts             INTEGER NOT NULL CHECK (max_attempts >= 1),
    backoff_base_ms          INTEGER NOT NULL CHECK (backoff_base_ms > 0),
    backoff_cap_ms           INTEGER NOT NULL CHECK (backoff_cap_ms >= backoff_base_ms),
    paused                   INTEGER NOT NULL DEFAULT 0,
    retry_after_max_ms       INTEGER NOT NULL DEFAULT 3600000,
    throttle_floor_ms        INTEGER NOT NULL DEFAULT 1000,
    throttle_backoff_base_ms INTEGER NOT NULL DEFAULT 1000,
    throttle_backoff_cap_ms  INTEGER NOT NULL DEFAULT 300000,
    max_throttles            INTEGER NOT NULL DEFAULT 100,
    ratelimit_reset          TEXT    CHECK (ratelimit_reset IN ('delta', 'epoch')),
    adaptive_rate            INTEGER NOT NULL DEFAULT 0,
    effective_interval_us    INTEGER NOT NULL CHECK (effective_interval_us > 0),
    throttle_streak          INTEGER NOT NULL DEFAULT 0,
    throttled_total          INTEGER NOT NULL DEFAULT 0,
    last_retry_after_ms      INTEGER,
    throttled_until_us       INTEGER,
    next_slot_us             INTEGER NOT NULL DEFAULT 0,
    due_at_us                INTEGER,
    backlog                  INTEGER NOT NULL DEFAULT 0 CHECK (backlog >= 0),
    in_flight                INTEGER NOT NULL DEFAULT 0 CHECK (in_flight >= 0),
    rejected_total           INTEGER NOT NULL DEFAULT 0,
    last_claimer             BLOB,
    created_at_us            INTEGER NOT NULL,
    updated_at_us            INTEGER NOT NULL
);

CREATE INDEX sluice_destinations_due ON sluice_destinations (due_at_us)
    WHERE due_at_us IS NOT NULL AND paused = 0;

CREATE TABLE sluice_jobs (
    id                  BLOB    PRIMARY KEY,
    destination_id      INTEGER NOT NULL REFERENCES sluice_destinations (id),
    state               TEXT    NOT NULL CHECK (state IN
                            ('queued', 'running', 'succeeded', 'dead', 'cancelled', 'expired')),
    method              TEXT    NOT NULL,
    url                 TEXT    NOT NULL,
    headers             TEXT    NOT NULL DEFAULT '[]',
    body                BLOB,
    idempotency_key     TEXT,
    attempts            INTEGER NOT NULL DEFAULT 0,
    max_attempts        INTEGER NOT NULL CHECK (max_attempts >= 1),
    throttles           INTEGER NOT NULL DEFAULT 0,
    last_retry_after_ms INTEGER,
    cost                INTEGER NOT NULL DEFAULT 1 CHECK (cost >= 1),
    run_at_us           INTEGER NOT NULL,
    deadline_us         INTEGER,
    slot_us             INTEGER,
    lease_until_us      INTEGER,
    worker_id           BLOB,
    last_status         INTEGER,
    last_error          TEXT,
    response_snippet    TEXT,
    created_at_us       INTEGER NOT NULL,
    updated_at_us       INTEGER NOT NULL,
    finished_at_us      INTEGER
);

CREATE INDEX sluice_jobs_ready ON sluice_jobs (destination_id, run_at_us, id)
    WHERE state = 'queued';
CREATE UNIQUE INDEX sluice_jobs_idempotency ON sluice_jobs (destination_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX sluice_jobs_leases ON sluice_jobs (lease_until_us) WHERE state = 'running';
CREATE INDEX sluice_jobs_deadlines ON sluice_jobs (deadline_us)
    WHERE state = 'queued' AND deadline_us IS NOT NULL;
CREATE INDEX sluice_jobs_finished ON sluice_jobs (finished_at_us)
    WHERE finished_at_us IS NOT NULL;
