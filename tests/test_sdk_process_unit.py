"""Unit tests of the SDK's background-process plumbing (no server): request bodies and the
parsing of ``…/output`` lines, offsets included."""

from __future__ import annotations

import json

import pytest

import sandlot
from sandlot.process import Process, signal_body, spawn_body


class _FakeSandbox:
    id = "sb-00000000000000000000"

    def _path(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{self.id}{suffix}"


def _proc() -> Process:
    return Process(_FakeSandbox(), {  # type: ignore[arg-type]
        "id": "pr-00000000000000000001", "sandbox_id": _FakeSandbox.id, "cmd": "x",
        "state": "running", "started_at": "2026-11-30T00:00:00Z", "ended_at": None,
        "stdin_open": True, "stdout_bytes": 0, "stderr_bytes": 0, "result": None})


def test_bodies():
    assert spawn_body("cat", None, None, b"hi", True, None, 100) == {
        "cmd": "cat", "stdin_b64": "aGk=", "stdin": True, "max_output_bytes": 100}
    assert "stdin" not in spawn_body(["true"], None, None, None, False, 5, None)
    assert signal_body("SIGTERM") == {"signal": "SIGTERM"} and signal_body(9) == {"signal": 9}
    with pytest.raises(TypeError):
        signal_body(True)


def test_output_lines_advance_offsets():
    p = _proc()
    assert p.running and (p.stdout_offset, p.stderr_offset) == (0, 0)
    ev = p._parse(json.dumps({"type": "skipped", "stream": "stdout", "from": 0, "to": 10}))
    assert ev == sandlot.OutputSkipped("stdout", 0, 10) and p.stdout_offset == 10
    ev = p._parse(json.dumps({"type": "stdout", "data": "\ufffd", "data_b64": "/w==",
                              "offset": 10}))
    assert ev == sandlot.StdoutChunk(b"\xff") and p.stdout_offset == 11
    ev = p._parse(json.dumps({"type": "stderr", "data": "ab", "offset": 3}))
    assert ev == sandlot.StderrChunk(b"ab") and p.stderr_offset == 5
    ev = p._parse(json.dumps({"type": "exit", "result": {"exit_code": 143, "signal": 15}}))
    assert isinstance(ev, sandlot.ExecResult) and ev.signal == 15
    assert p.state == "exited" and p.result.exit_code == 143
    with pytest.raises(sandlot.NotFound):
        p._parse(json.dumps({"type": "error", "error": {"code": "not_found", "message": "m"}}))
    with pytest.raises(sandlot.ProtocolError):
        p._parse("{}")
