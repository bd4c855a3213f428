"""The conformance suite: the same exec, file, lifecycle, limit and error cases against every
backend of the session server (DESIGN.md, "Every backend passes the same conformance suite").
Cases, skips and the SANDLOT_REQUIRE_BACKENDS switch: see conftest.py here and
docs/backends.md, "Conformance suite"."""
