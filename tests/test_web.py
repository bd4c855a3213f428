"""Observability end to end: `/metrics`, `/v1/events` and the status page at `/` of the live
server; the page is loaded in headless Debian `chromium` (skipped, with the reason, when it
is not installed), which keeps a screenshot in $SANDLOT_E2E_LOG_DIR or tests/artifacts/."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import urllib.request
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EVIL = "<img src=x onerror=document.title='pwned'>"


def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.headers.get("content-type", ""), r.read().decode()


def _artifacts() -> Path:
    d = Path(os.environ.get("SANDLOT_E2E_LOG_DIR") or REPO / "tests" / "artifacts")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _chromium(url: str, *extra: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    if exe is None:
        pytest.skip("Debian `chromium` is not installed (apt-get install chromium); "
                    "the status page is not checked in a browser here")
    with tempfile.TemporaryDirectory(prefix="sandlot-chromium-") as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
               "--window-size=1280,900",
               # Let the page's script fetch and render before the dump/screenshot.
               "--virtual-time-budget=4000", *extra, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_metrics_and_events_live(client, sb, server):
    r = sb.exec(["python3", "-c", "print(6*7)"], timeout_s=30)
    assert r.exit_code == 0
    status, ctype, text = _get(f"{server.url}/metrics")
    assert status == 200 and ctype.startswith("application/openmetrics-text"), ctype
    assert text.endswith("# EOF\n")
    assert 'sandlot_exec_seconds_count{backend="function",outcome="ok"}' in text
    assert 'sandlot_create_seconds_bucket{le="+Inf",backend="function"}' in text
    assert 'sandlot_sandboxes{backend="function",state="running"}' in text

    _, _, body = _get(f"{server.url}/v1/events?sandbox={sb.id}")
    evs = json.loads(body)["events"]
    assert [e["kind"] for e in evs][:1] == ["created"]
    ex = [e for e in evs if e["kind"] == "exec"]
    assert len(ex) == 1 and ex[0]["exit_code"] == 0 and ex[0]["timed_out"] is False
    assert len(ex[0]["command_digest"]) == 64 and "print" not in json.dumps(ex[0])


def test_status_page_in_chromium(client, python_image, server):
    tag = uuid.uuid4().hex[:8]
    with client.create(image=python_image, memory_mib=128, ttl_s=300,
                       labels={"web": tag, "evil": EVIL}) as box:
        box.exec(["true"], timeout_s=30)
        url = f"{server.url}/"
        dom = _chromium(url, "--dump-dom")
        assert dom.returncode == 0, dom.stderr[-2000:]
        html = dom.stdout
        assert box.id in html, html[:3000]
        # Rendered by the script (the server render leaves the events table empty).
        assert 'id="events"' in html and "exec" in html, html[-3000:]
        assert '<span id="err"></span>' in html, html[:3000]  # no "refresh failed: ..."
        # The charts of the last 10 minutes drew this create and exec (GET /v1/timeline).
        for chart in ("chart-creates", "chart-exec"):
            svg = re.search(rf'<svg id="{chart}"[^>]*>(.*?)</svg>', html, re.S)
            assert svg and "<rect" in svg.group(1), (chart, html[:3000])
        # The label stays text: escaped in the DOM, no element made from it, script not run.
        assert "&lt;img src=x" in html
        assert "<img" not in html
        assert "<title>pwned</title>" not in html

        shot = _artifacts() / "status-page.png"
        if shot.exists():
            shot.unlink()
        out = _chromium(url, f"--screenshot={shot}")
        assert out.returncode == 0, out.stderr[-2000:]
        assert shot.is_file() and shot.stat().st_size > 10_000, shot
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        print(f"\nstatus page screenshot: {shot}")
