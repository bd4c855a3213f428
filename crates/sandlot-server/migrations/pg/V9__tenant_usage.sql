-- Per-tenant usage (issue 22): the count, cpu and memory of each tenant's sandboxes in any
-- state but `deleting`, kept exact by the triggers below, so a create's quota check reads
-- one row instead of summing the tenant's sandboxes (O(n) per create, O(n²) per job).
-- `tenant` is '' for sandboxes without one (authentication off; tenant ids are `key_…`);
-- cpu is in millicores (rounded per sandbox) so the sums stay exact. The row is also the
-- lock of a create that checks the quota: a group transaction takes the rows of the
-- tenants it inserts for (and of those whose sandboxes it moves into or out of
-- `deleting`) FOR UPDATE, sorted, before its first statement. It replaces `tenant_locks`.
CREATE TABLE tenant_usage (
    tenant TEXT PRIMARY KEY,
    n      BIGINT NOT NULL DEFAULT 0,
    mcpu   BIGINT NOT NULL DEFAULT 0,
    mem    BIGINT NOT NULL DEFAULT 0
);

-- A sandbox's cpu in millicores, as counted in `tenant_usage.mcpu`.
CREATE FUNCTION sandlot_mcpu(spec JSONB) RETURNS BIGINT
LANGUAGE sql IMMUTABLE AS $$
  SELECT COALESCE(round((spec ->> 'cpu')::float8 * 1000), 0)::bigint
$$;

-- A sandbox's memory in MiB, as counted in `tenant_usage.mem`.
CREATE FUNCTION sandlot_mem(spec JSONB) RETURNS BIGINT
LANGUAGE sql IMMUTABLE AS $$
  SELECT COALESCE((spec ->> 'memory_mib')::bigint, 0)
$$;

-- No write of a running (older) server lands between the backfill and the triggers.
LOCK TABLE sandboxes IN SHARE ROW EXCLUSIVE MODE;

INSERT INTO tenant_usage (tenant, n, mcpu, mem)
SELECT COALESCE(tenant, ''), COUNT(*), SUM(sandlot_mcpu(spec)), SUM(sandlot_mem(spec))
FROM sandboxes WHERE state != 'deleting' GROUP BY 1;

-- Inserts: one upsert per tenant per statement (a bulk insert of unnest arrays updates
-- each tenant's row once), in tenant order.
CREATE FUNCTION sandlot_usage_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO tenant_usage AS u (tenant, n, mcpu, mem)
  SELECT COALESCE(tenant, ''), COUNT(*), SUM(sandlot_mcpu(spec)), SUM(sandlot_mem(spec))
  FROM sandlot_new WHERE state != 'deleting' GROUP BY 1 ORDER BY 1
  ON CONFLICT (tenant) DO UPDATE
    SET n = u.n + EXCLUDED.n, mcpu = u.mcpu + EXCLUDED.mcpu, mem = u.mem + EXCLUDED.mem;
  RETURN NULL;
END $$;
CREATE TRIGGER sandboxes_usage_insert AFTER INSERT ON sandboxes
  REFERENCING NEW TABLE AS sandlot_new
  FOR EACH STATEMENT EXECUTE FUNCTION sandlot_usage_insert();

-- Deletes: what the deleted rows not in `deleting` counted, per tenant.
CREATE FUNCTION sandlot_usage_delete() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  UPDATE tenant_usage AS u SET n = u.n - d.n, mcpu = u.mcpu - d.mcpu, mem = u.mem - d.mem
  FROM (SELECT COALESCE(tenant, '') AS tenant, COUNT(*) AS n,
          SUM(sandlot_mcpu(spec)) AS mcpu, SUM(sandlot_mem(spec)) AS mem
        FROM sandlot_old WHERE state != 'deleting' GROUP BY 1) d
  WHERE u.tenant = d.tenant;
  RETURN NULL;
END $$;
CREATE TRIGGER sandboxes_usage_delete AFTER DELETE ON sandboxes
  REFERENCING OLD TABLE AS sandlot_old
  FOR EACH STATEMENT EXECUTE FUNCTION sandlot_usage_delete();

-- Updates: a row level trigger limited (column list, WHEN) to the changes that move a row
-- into or out of the count (state to or from `deleting`; tenant and spec, which no
-- statement of the server changes today), so claims and other updates cost nothing.
CREATE FUNCTION sandlot_usage_update() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF OLD.state != 'deleting' THEN
    UPDATE tenant_usage SET n = n - 1, mcpu = mcpu - sandlot_mcpu(OLD.spec),
      mem = mem - sandlot_mem(OLD.spec)
    WHERE tenant = COALESCE(OLD.tenant, '');
  END IF;
  IF NEW.state != 'deleting' THEN
    INSERT INTO tenant_usage AS u (tenant, n, mcpu, mem)
    VALUES (COALESCE(NEW.tenant, ''), 1, sandlot_mcpu(NEW.spec), sandlot_mem(NEW.spec))
    ON CONFLICT (tenant) DO UPDATE
      SET n = u.n + 1, mcpu = u.mcpu + EXCLUDED.mcpu, mem = u.mem + EXCLUDED.mem;
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER sandboxes_usage_update AFTER UPDATE OF state, tenant, spec ON sandboxes
  FOR EACH ROW
  WHEN ((OLD.state = 'deleting') IS DISTINCT FROM (NEW.state = 'deleting')
        OR OLD.tenant IS DISTINCT FROM NEW.tenant OR OLD.spec IS DISTINCT FROM NEW.spec)
  EXECUTE FUNCTION sandlot_usage_update();

-- A server of an older version still running would lock this table around its quota
-- check; without it its quota'd creates fail (503) instead of racing the new servers'.
DROP TABLE tenant_locks;
