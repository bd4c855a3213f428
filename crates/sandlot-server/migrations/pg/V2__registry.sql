-- Sandbox registry (cluster mode): the PostgreSQL twin of the SQLite `sandboxes` and
-- `idempotency` tables of src/store.rs. Times are Unix milliseconds; `spec` is SpecJson,
-- `labels` a string map. `seq` orders rows of one created_at like SQLite's rowid.
CREATE TABLE sandboxes (
    seq        BIGSERIAL NOT NULL,
    id         TEXT PRIMARY KEY,
    backend    TEXT NOT NULL,
    image      TEXT NOT NULL,
    state      TEXT NOT NULL,
    node       TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    expires_at BIGINT,
    spec       JSONB NOT NULL,
    labels     JSONB NOT NULL,
    tenant     TEXT,
    -- The server running a `creating` / `deleting` transition, and when another server may
    -- take it over (finish or roll back): Registry::set_transition / stale_transitions.
    owner      TEXT,
    deadline   BIGINT
);
CREATE INDEX sandboxes_expires ON sandboxes (expires_at);
CREATE INDEX sandboxes_trajectory ON sandboxes ((spec ->> 'trajectory'));
CREATE INDEX sandboxes_tenant ON sandboxes (tenant);
CREATE INDEX sandboxes_deadline ON sandboxes (deadline) WHERE deadline IS NOT NULL;

-- One Idempotency-Key maps to exactly one sandbox (the primary key).
CREATE TABLE idempotency (
    key        TEXT PRIMARY KEY,
    digest     TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE INDEX idempotency_sandbox ON idempotency (sandbox_id);

-- One row per tenant ('' = no authentication), locked FOR UPDATE by a create that checks
-- the tenant's quota, so two servers cannot both admit its last slot.
CREATE TABLE tenant_locks (
    tenant TEXT PRIMARY KEY
);
