"""A microVM whose QEMU exits during boot fails its create at once, not at the readiness
timeout (120 s under TCG), and leaves nothing behind.

The guest kernel is given an init that does not exist (``SANDLOT_MICROVM_APPEND``), so it
panics; the node runs QEMU with ``-no-reboot`` and ``panic=-1``, so QEMU exits. Templates
are off (a template start would not boot this kernel command line).
"""

from __future__ import annotations

import os
import time

import pytest

import sandlot
from conftest import Server, private_base, remove_private_base


def test_qemu_exit_during_boot_fails_the_create_at_once(binary, log_dir, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("microVM tests need root (cgroups, QEMU)")
    monkeypatch.setenv("SANDLOT_MICROVM_APPEND", "rdinit=/nonexistent init=/nonexistent")
    monkeypatch.setenv("SANDLOT_MICROVM_TEMPLATES", "0")
    base = private_base("sandlot-bootfail-")
    srv = Server(binary, base / "data", log_dir / "vm-boot-failure.log")
    try:
        srv.start()
        with sandlot.Client(srv.url, timeout=200, retries=0) as c:
            status = c._request("GET", "/healthz").json().get("backends", {}).get("microvm")
            if status != "ok":
                pytest.skip(f"backend microvm is not available here: {status}")
            t0 = time.monotonic()
            with pytest.raises(sandlot.SandlotError) as err:
                c.create(backend="microvm", image="python", ttl_s=300)
            took = time.monotonic() - t0
            assert "QEMU exited" in str(err.value), err.value
            # The readiness limit under TCG is 120 s; the kernel panics within seconds.
            assert took < 90, f"create failed only after {took:.0f} s: {err.value}"
            assert c.list() == [], "no half-created sandbox is left"
        kept = list((base / "data" / "microvm" / "failed").glob("*.console.log"))
        assert kept, "the failed boot's console is kept"
        assert not list((base / "data" / "microvm" / "vms").glob("*")), "no VM directory left"
    finally:
        srv.stop()
        remove_private_base(base)
