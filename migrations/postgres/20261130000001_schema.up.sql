-- Sluice schema. All instants are bigint microseconds since the Unix epoch, taken from the
-- database clock (sluice_now_us), so slot arithmetic is exact integer math and one clock
-- rules every dispatcher (DESIGN invariant 6).

CREATE FUNCTION sluice_now_us() RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
    SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint
$$;

-- One row per downstream. The row is the coordination point between dispatchers:
-- next_slot_us (GCRA's theoretical arrival time) is advanced by whoever claims, under the
-- row lock, so all dispatchers together keep one rate.
--
-- Room to grow: a destination's primary limit lives on this row because every claim reads
-- it. Further limits (say 10000/day beside 10/s) will live in a child table with their own
-- next_slot, advanced in the same claim transaction; jobs already carry a cost.
CREATE TABLE sluice_destinations (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name              text    NOT NULL UNIQUE,
    rate              text    NOT NULL,                   -- as written, e.g. '50/s'
    interval_us       bigint  NOT NULL CHECK (interval_us > 0),
    burst             integer NOT NULL DEFAULT 1 CHECK (burst >= 1),
    capacity          bigint  NOT NULL CHECK (capacity >= 1),
    max_in_flight     integer CHECK (max_in_flight >= 1),
    allowed_base_urls text[]  NOT NULL DEFAULT '{}',
    timeout_ms        integer NOT NULL CHECK (timeout_ms > 0),
    max_attempts      integer NOT NULL CHECK (max_attempts >= 1),
    backoff_base_ms   bigint  NOT NULL CHECK (backoff_base_ms > 0),
    backoff_cap_ms    bigint  NOT NULL CHECK (backoff_cap_ms >= backoff_base_ms),
    paused            boolean NOT NULL DEFAULT false,
    -- Throttling policy (see src/throttle.rs).
    retry_after_max_ms       bigint  NOT NULL DEFAULT 3600000 CHECK (retry_after_max_ms > 0),
    throttle_floor_ms        bigint  NOT NULL DEFAULT 1000 CHECK (throttle_floor_ms >= 0),
    throttle_backoff_base_ms bigint  NOT NULL DEFAULT 1000 CHECK (throttle_backoff_base_ms > 0),
    throttle_backoff_cap_ms  bigint  NOT NULL DEFAULT 300000,
    max_throttles            integer NOT NULL DEFAULT 100 CHECK (max_throttles >= 1),
    ratelimit_reset          text    CHECK (ratelimit_reset IN ('delta', 'epoch')),
    adaptive_rate            boolean NOT NULL DEFAULT false,
    -- The interval claims use: interval_us, or longer while adaptive_rate backs off.
    effective_interval_us    bigint  NOT NULL CHECK (effective_interval_us > 0),
    -- Throttling state: consecutive throttles (drives the no-hint backoff), totals, and
    -- the instant the latest throttle holds the destination until.
    throttle_streak          integer NOT NULL DEFAULT 0,
    throttled_total          bigint  NOT NULL DEFAULT 0,
    last_retry_after_ms      bigint,
    throttled_until_us       bigint,
    -- GCRA state: the earliest instant of the next release (before burst tolerance).
    next_slot_us      bigint  NOT NULL DEFAULT 0,
    -- When the destination next has work a dispatcher could claim, or NULL when it has
    -- none (no queued job, or max_in_flight reached). May be early, never late: an early
    -- value costs one empty claim, a late one would strand work. Kept by every statement
    -- that changes its inputs; the partial index below is how dispatchers find due
    -- destinations without scanning all destinations or all jobs.
    due_at_us         bigint,
    -- Admission counter: jobs admitted and not yet final (queued + running). Enqueue
    -- checks it against capacity under the row lock.
    backlog           bigint  NOT NULL DEFAULT 0 CHECK (backlog >= 0),
    -- Jobs claimed and not yet finished (state running), for max_in_flight.
    in_flight         integer NOT NULL DEFAULT 0 CHECK (in_flight >= 0),
    rejected_total    bigint  NOT NULL DEFAULT 0,
    -- The dispatcher that made the latest claim. A dispatcher that finds another one
    -- here knows it shares the destination, and treats its late releases more strictly.
    last_claimer      uuid,
    created_at_us     bigint  NOT NULL DEFAULT sluice_now_us(),
    updated_at_us     bigint  NOT NULL DEFAULT sluice_now_us()
) WITH (fillfactor = 50);

CREATE INDEX sluice_destinations_due ON sluice_destinations (due_at_us)
    WHERE due_at_us IS NOT NULL AND NOT paused;

CREATE TABLE sluice_jobs (
    id               uuid    PRIMARY KEY,                -- UUIDv7, sent as Idempotency-Key
    destination_id   bigint  NOT NULL REFERENCES sluice_destinations (id),
    state            text    NOT NULL CHECK (state IN
                        ('queued', 'running', 'succeeded', 'dead', 'cancelled', 'expired')),
    method           text    NOT NULL,
    url              text    NOT NULL,
    headers          jsonb   NOT NULL DEFAULT '[]',      -- [[name, value], ...]
    body             bytea,
    idempotency_key  text,
    attempts         integer NOT NULL DEFAULT 0,
    max_attempts     integer NOT NULL CHECK (max_attempts >= 1),
    throttles        integer NOT NULL DEFAULT 0,
    last_retry_after_ms bigint,
    cost             integer NOT NULL DEFAULT 1 CHECK (cost >= 1),
    -- Queue order and earliest release: enqueue time, not_before, or the end of a backoff.
    -- A throttled or rescued job keeps its run_at, so it returns to the head of its line.
    run_at_us        bigint  NOT NULL,
    deadline_us      bigint,
    slot_us          bigint,                              -- release slot of the latest claim
    lease_until_us   bigint,                              -- while running
    worker_id        uuid,                                -- dispatcher holding the claim
    last_status      integer,
    last_error       text,
    response_snippet text,
    created_at_us    bigint  NOT NULL DEFAULT sluice_now_us(),
    updated_at_us    bigint  NOT NULL DEFAULT sluice_now_us(),
    finished_at_us   bigint
) WITH (
    fillfactor = 80,
    -- Every job is inserted, updated twice and deleted by retention: vacuum early and
    -- without throttling, or dead tuples pile up faster than autovacuum's defaults clear.
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 0
);

-- The claim query: per destination, queued jobs in (run_at, id) order.
CREATE INDEX sluice_jobs_ready ON sluice_jobs (destination_id, run_at_us, id)
    WHERE state = 'queued';
-- Idempotent enqueue.
CREATE UNIQUE INDEX sluice_jobs_idempotency ON sluice_jobs (destination_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- Lease rescue and shutdown: running jobs by lease expiry.
CREATE INDEX sluice_jobs_leases ON sluice_jobs (lease_until_us)
    WHERE state = 'running';
-- Expiry of queued jobs that no claim will meet (paused or stalled destinations).
CREATE INDEX sluice_jobs_deadlines ON sluice_jobs (deadline_us)
    WHERE state = 'queued' AND deadline_us IS NOT NULL;
-- Retention: finished jobs by age.
CREATE INDEX sluice_jobs_finished ON sluice_jobs (finished_at_us)
    WHERE finished_at_us IS NOT NULL;

-- When a destination next has claimable work, given the values its row will have.
-- NULL when nothing is queued or max_in_flight is reached.
CREATE FUNCTION sluice_due_at(
    dest bigint, next_slot bigint, interval_us bigint, burst integer,
    in_flight integer, max_in_flight integer
) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN max_in_flight IS NOT NULL AND in_flight >= max_in_flight THEN NULL
        ELSE (SELECT greatest(next_slot - (burst - 1) * interval_us, j.run_at_us)
                FROM sluice_jobs j
               WHERE j.destination_id = dest AND j.state = 'queued'
               ORDER BY j.run_at_us, j.id
               LIMIT 1)
    END
$$;
