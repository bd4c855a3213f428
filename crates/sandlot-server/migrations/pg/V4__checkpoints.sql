-- Checkpoint records: the PostgreSQL twin of SQLite's `checkpoints` (src/checkpoints.rs,
-- CheckpointRow). Times are Unix milliseconds, sizes bytes / MiB.
CREATE TABLE checkpoints (
    id         TEXT PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    backend    TEXT NOT NULL,
    image      TEXT NOT NULL,
    runtime    TEXT,
    disk_mib   BIGINT NOT NULL,
    size_bytes BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    tenant     TEXT
);
