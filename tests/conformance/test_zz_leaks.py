"""Runs last for each backend case (file order; pytest groups the tests of one case): once
every sandbox the suite made on the case is deleted, the node holds no more sandbox
directories, mounts, cgroups, processes or veths than before the case's first test."""

from __future__ import annotations

from conftest import wait_no_leaks


def test_nothing_left_after_the_case(client, server, backend, leak_baseline):
    live = [b for b in client.list(labels=backend.labels) if b.state != "deleted"]
    for box in live:
        box.delete()
    # Every test deletes what it made; a live sandbox here is a test (or delete) bug.
    assert live == [], f"still running after their tests: {[b.id for b in live]}"
    assert all(b.state == "deleted" for b in client.list(labels=backend.labels))
    after = wait_no_leaks(server.data_dir, leak_baseline, 30, what=f"by {backend.name}")
    print(f"\n{backend.name}: node resources before {leak_baseline}, after {after}")
