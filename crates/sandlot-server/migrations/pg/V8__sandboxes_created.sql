-- Paged lists (`GET /v1/sandboxes?limit=…&page_token=…`, Registry::list_page) walk the
-- registry in (created_at, id) order from a cursor: an index instead of a sort of every row.
CREATE INDEX sandboxes_created ON sandboxes (created_at, id);
