"""Hardening findings end to end that are specific to the function backend and run_code: what
untrusted code does to its own sandbox must come back as a clear 4xx/429 or as the program's
own verdict, never as a 500 or a SandboxError. The findings every backend shares (sparse
file reads within the server's budget, exec at the pids limit, upload past the disk quota,
/dev/null and the standard directories) are in conformance/test_limits.py and
conformance/test_errors.py."""

from __future__ import annotations

import pytest

import sandlot


def test_run_code_unreadable_fetch_files_keep_the_verdict(client, python_image):
    """Finding 2: links into /proc, FIFOs, directories are left out; no SandboxError."""
    prep = ("import os\n"
            "os.symlink('/proc/1/environ', 'plink')\n"
            "os.mkfifo('fifo')\n"
            "os.mkdir('d')\n"
            "open('ok.txt', 'w').write('ok')\n")
    for tail, status in [("print('hi')\n", "Success"), ("raise SystemExit(3)\n", "Failed")]:
        r = client.run_code(prep + tail, fetch_files=["plink", "fifo", "d", "ok.txt", "nope"])
        assert r.status == status, r
        assert r.run_result is not None
        assert r.files.get("ok.txt") == b"ok", r
        assert set(r.files) == {"ok.txt"}, r
        for name in ("plink", "fifo", '"d"'):
            assert name in r.message, r.message


def test_dev_null_bind_mount_is_not_detached(sb):
    """Finding 5: in the function jail /dev/null is a bind mount; the files API refuses to
    replace or remove it as a mount point, and the mount stays (the refusal itself, on
    every backend: conformance/test_errors.py)."""
    for call in (lambda: sb.write_file("/dev/null", b"x"), lambda: sb.remove("/dev/null")):
        with pytest.raises(sandlot.InvalidArgument) as ei:
            call()
        assert "mount point" in str(ei.value)
    r = sb.exec("grep -c ' /dev/null ' /proc/self/mountinfo")
    assert r.exit_code == 0 and r.stdout.strip() == b"1", r
