-- API keys (tenants and their quotas) and trajectory ownership: the PostgreSQL twins of
-- SQLite's `api_keys` and `trajectory_owners` (src/store.rs). Only the key's SHA-256 (hex)
-- is stored. Times are Unix milliseconds.
CREATE TABLE api_keys (
    seq            BIGSERIAL NOT NULL,
    id             TEXT PRIMARY KEY,
    name           TEXT NOT NULL,
    digest         TEXT NOT NULL UNIQUE,
    admin          BOOLEAN NOT NULL,
    max_sandboxes  BIGINT,
    max_cpu        DOUBLE PRECISION,
    max_memory_mib BIGINT,
    created_at     BIGINT NOT NULL,
    revoked_at     BIGINT
);

-- Which tenant a trajectory id belongs to (claimed by its first authenticated create).
CREATE TABLE trajectory_owners (
    trajectory TEXT PRIMARY KEY,
    tenant     TEXT NOT NULL
);
CREATE INDEX idempotency_created ON idempotency (created_at);
