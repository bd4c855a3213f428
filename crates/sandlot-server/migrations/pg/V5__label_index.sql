-- List by label without a scan of every record: `labels @> '{"k": "v", ...}'` (the AND of
-- the pairs) uses this GIN index (issue 22: list, pause and resume of one job's sandboxes
-- by its `job` label at hundreds of thousands of records).
CREATE INDEX sandboxes_labels ON sandboxes USING GIN (labels jsonb_path_ops);
