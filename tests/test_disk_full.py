"""A full data directory (issue 25, items 3 and 5).

The data directory is a small tmpfs mounted for the test; the host fills it, as a sandbox
writing into its own writable layer (which lives there) would.

- Reserve: below `--disk-reserve-mib` (default 256 MiB), creates and run_code answer `429 resource_exhausted`
  with a clear message, while lists, gets, execs and deletes still work, and freeing space
  lets creates through again. Before, creates went on until SQLite could not commit and then
  answered `500 internal "sqlite commit"` for everyone.
- Audit events: with the disk completely full, an exec whose event cannot be written fails
  (503) instead of answering 200 with an event kept in memory only; the queued event is
  written once space is back; after a restart every exec that answered 200 has its event,
  and new event ids are above every id ever shown (before, memory-only events vanished at
  the restart and their ids were handed out again).
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import httpx
import pytest

import sandlot
from conftest import Server, private_base, wait_until


def _mount_tmpfs(path: Path, size_mib: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0711", "tmpfs",
                        str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs data directory: {r.stderr.strip()}")


def _avail(path: Path) -> int:
    s = os.statvfs(path)
    return s.f_bavail * s.f_frsize


def _fill(path: Path, leave: int = 0) -> Path:
    """Write DATA/filler until only ``leave`` bytes (or nothing) are free."""
    filler = path / "filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb") as f:
        try:
            while True:
                room = _avail(path) - leave
                if room <= 0:
                    break
                f.write(chunk[:min(len(chunk), room)])
                f.flush()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    return filler


@pytest.fixture
def tmpfs_node(binary, log_dir, request):
    if os.geteuid() != 0:
        pytest.skip("end-to-end tests need root")
    size_mib, args = request.param
    base = private_base("sandlot-disk-")
    data = base / "data"
    _mount_tmpfs(data, size_mib)
    srv = Server(binary, data, log_dir / f"disk-full-{size_mib}.log",
                 args=["--warm-pool", "0", "--container-warm-pool", "0", *args])
    try:
        srv.start()
        yield srv
    finally:
        try:
            (data / "filler").unlink(missing_ok=True)
            srv.delete_all()
        finally:
            srv.stop()
            subprocess.run(["umount", "-l", str(data)], check=False)
            subprocess.run(["rm", "-rf", str(base)], check=False)


def _create(c: sandlot.Client) -> sandlot.Sandbox:
    try:
        return c.create(backend="function", image="busybox", memory_mib=64, ttl_s=600)
    except (sandlot.NotFound, sandlot.Unavailable) as e:
        pytest.skip(f"no usable busybox function sandbox here: {e}")


# No flags: the default reserve is 256 MiB; the tmpfs has 320 MiB.
@pytest.mark.parametrize("tmpfs_node", [(320, [])], indirect=True)
def test_below_the_reserve_creates_are_refused_and_reads_and_deletes_work(tmpfs_node):
    srv = tmpfs_node
    with sandlot.Client(srv.url, timeout=60, retries=0) as c:
        box = _create(c)
        filler = _fill(srv.data_dir, leave=128 << 20)
        r = httpx.post(f"{srv.url}/v1/sandboxes", json={"image": "busybox"}, timeout=30)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "resource_exhausted" and "below its reserve" in err["message"], err
        assert r.headers.get("retry-after")
        r = httpx.post(f"{srv.url}/run_code", json={"code": "print(1)", "language": "python"},
                       timeout=60)
        assert r.status_code == 429, r.text
        assert [b.id for b in c.list()] == [box.id]
        assert c.get(box.id).state == "running"
        assert box.exec(["echo", "still"]).stdout == b"still\n"
        box.delete()
        assert c.list() == []
        filler.unlink()
        again = _create(c)
        again.delete()


def _events(url: str, **params) -> list:
    return httpx.get(f"{url}/v1/events", params={"limit": 1000, **params}, timeout=10).json()["events"]


def _pending(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("sandlot_events_pending "):
            return float(line.split()[-1])
    return 0.0


# No flags: the default reserve (256 MiB) is below the tmpfs's free space at first.
@pytest.mark.parametrize("tmpfs_node", [(320, [])], indirect=True)
def test_events_are_durable_or_the_call_fails_and_ids_are_never_reused(tmpfs_node):
    srv = tmpfs_node
    with sandlot.Client(srv.url, timeout=60, retries=0) as c:
        box = _create(c)
        for _ in range(3):
            box.exec(["true"])
    filler = _fill(srv.data_dir)
    assert _avail(srv.data_dir) < (1 << 20)
    ok = failed = 0
    for _ in range(5):
        r = httpx.post(f"{srv.url}/v1/sandboxes/{box.id}/exec", json={"cmd": ["true"]}, timeout=60)
        if r.status_code == 200:
            ok += 1
        else:
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "unavailable", r.text
            failed += 1
    seen = max(e["id"] for e in _events(srv.url))
    print(f"disk full: {ok} execs answered 200, {failed} answered 503; highest id shown {seen}")
    filler.unlink()
    wait_until(lambda: _pending(srv.url) == 0, timeout=10, what="queued events written")
    srv.restart()
    with sandlot.Client(srv.url, timeout=60, retries=0) as c:
        c.get(box.id).exec(["true"])
    execs = _events(srv.url, sandbox=box.id, kind="exec")
    # Every exec that answered 200 has a durable event (3 before the fill + ok + 1 after),
    # and so do the ones that answered 503 (written once space was back).
    assert len(execs) >= 3 + ok + 1, (len(execs), ok)
    assert execs[-1]["id"] > seen, f"id {execs[-1]['id']} reused (ids up to {seen} were shown)"
    ids = [e["id"] for e in _events(srv.url)]
    assert ids == sorted(set(ids)), "ids unique and increasing"
