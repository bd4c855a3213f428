-- Trajectory log (cluster mode): the PostgreSQL twin of the SQLite schema in
-- src/trajectory_store.rs. Times are Unix milliseconds (BIGINT); request/result are the same
-- JSON encodings as SQLite's; outputs over INLINE_MAX bytes live in blobs by SHA-256.
CREATE TABLE trajectories (
    id             TEXT PRIMARY KEY,
    next_step      BIGINT NOT NULL,
    replayed_total BIGINT NOT NULL DEFAULT 0,
    created_at     BIGINT NOT NULL,
    last_activity  BIGINT NOT NULL
);
CREATE INDEX trajectories_activity ON trajectories (last_activity);

CREATE TABLE steps (
    trajectory   TEXT NOT NULL,
    step         BIGINT NOT NULL,
    kind         TEXT NOT NULL,
    digest       TEXT NOT NULL,
    request      TEXT NOT NULL,
    result       TEXT NOT NULL,
    exit_code    INTEGER,
    created_at   BIGINT NOT NULL,
    replay_count BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (trajectory, step)
);

CREATE TABLE blobs (
    sha256 TEXT PRIMARY KEY,
    data   BYTEA NOT NULL
);

CREATE TABLE step_blobs (
    trajectory TEXT NOT NULL,
    step       BIGINT NOT NULL,
    sha256     TEXT NOT NULL
);
CREATE INDEX step_blobs_traj ON step_blobs (trajectory);
CREATE INDEX step_blobs_sha ON step_blobs (sha256);
