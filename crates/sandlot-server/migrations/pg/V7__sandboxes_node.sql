-- The lost-node sweep selects a departed node's records (Registry::mark_node_lost): an
-- index instead of a scan of every record.
CREATE INDEX sandboxes_node ON sandboxes (node);
