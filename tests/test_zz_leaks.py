"""Runs last (file order): once every sandbox of the session server is deleted, nothing of
them is left on the host — no sandbox directories and no mounts under its data dir."""

from __future__ import annotations

from conftest import count_leaks, wait_until


def test_nothing_left_after_deleting_everything(client, server, python_image):
    for box in client.list():
        if box.state != "deleted":
            box.delete()
    assert all(b.state == "deleted" for b in client.list())

    def clean() -> bool:
        c = count_leaks(server.data_dir)
        return c["sandbox_dirs"] == 0 and c["mounts"] == 0

    wait_until(clean, 30, what=f"no sandbox dirs/mounts left: {count_leaks(server.data_dir)}")
    # Host-wide counters (other Sandlot processes on this host may own some): for the log.
    print(f"\nhost-wide leftovers after the suite: {count_leaks(server.data_dir)}")
