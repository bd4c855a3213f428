-- Names of E2B snapshots (`POST /sandboxes/{id}/snapshots {name}`; src/e2b/control.rs), by
-- checkpoint id: the PostgreSQL twin of SQLite's `checkpoint_names` (src/checkpoints.rs).
-- A row goes with its checkpoint (`remove_checkpoint` deletes both).
CREATE TABLE checkpoint_names (
    checkpoint_id TEXT PRIMARY KEY,
    name          TEXT NOT NULL
);
CREATE INDEX checkpoint_names_name ON checkpoint_names (name);
