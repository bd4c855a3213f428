"""Files API (DESIGN.md, "Files"), identical on every backend: exact bytes, any UTF-8 path,
no escapes through `..` or symlinks."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import pytest

import sandlot


def test_binary_round_trip(sb):
    data = bytes(range(256)) * 64 + os.urandom(4096) + b"\x00\r\n\xff"
    sb.write_file("bin/data.bin", data)
    assert sb.read_file("bin/data.bin") == data
    assert sb.read_file("/workspace/bin/data.bin") == data  # relative = under /workspace
    r = sb.exec(["sha256sum", "bin/data.bin"])
    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    # A file written inside is read back exactly.
    sb.exec(["python3", "-c", "open('made.bin','wb').write(bytes(range(255,-1,-1)))"])
    assert sb.read_file("made.bin") == bytes(range(255, -1, -1))


def test_unicode_and_space_paths(sb):
    path = "dir with space/файл ü 日本 #?&=%.txt"
    sb.write_file(path, "contenu é\n")
    assert sb.read_file(path) == "contenu é\n".encode()
    names = [e.name for e in sb.list_dir("dir with space")]
    assert names == ["файл ü 日本 #?&=%.txt"]
    r = sb.exec(["cat", path])
    assert r.stdout == "contenu é\n".encode()


def test_list_dir_entries(sb):
    sb.write_file("ls/a.txt", b"12345")
    sb.exec("mkdir -p ls/sub && ln -s a.txt ls/link && chmod 600 ls/a.txt")
    entries = {e.name: e for e in sb.list_dir("ls")}
    assert sorted(entries) == ["a.txt", "link", "sub"]
    assert entries["a.txt"].type == "file" and entries["a.txt"].size == 5
    assert entries["a.txt"].mode & 0o777 == 0o600
    assert entries["sub"].type == "dir" and entries["link"].type == "symlink"
    assert entries["a.txt"].mtime > 1_600_000_000


@pytest.mark.parametrize("size", [20 * 1024, 50 * 1024 * 1024], ids=["20KB", "50MB"])
def test_sizes(sb, size):
    data = os.urandom(size)
    sb.write_file(f"size-{size}.bin", data)
    back = sb.read_file(f"size-{size}.bin")
    assert len(back) == size and back == data
    r = sb.exec(["sh", "-c", f"wc -c < size-{size}.bin"])
    assert int(r.stdout) == size
    sb.remove(f"size-{size}.bin")  # the module's sandbox is shared


def test_overwrite_and_remove(sb):
    sb.write_file("x.txt", "one")
    sb.write_file("x.txt", "two")
    assert sb.read_file("x.txt") == b"two"
    sb.remove("x.txt")
    with pytest.raises(sandlot.NotFound):
        sb.read_file("x.txt")
    sb.write_file("tree/a/b/c.txt", "deep")
    sb.remove("tree")
    assert sb.exec("test -e tree; echo $?").stdout == b"1\n"


def test_missing_file_is_not_found(sb):
    with pytest.raises(sandlot.NotFound):
        sb.read_file("no-such-file.txt")
    with pytest.raises(sandlot.NotFound):
        sb.list_dir("no-such-dir")


@pytest.fixture
def host_secret(tmp_path_factory):
    """A host file outside every sandbox, with content no sandbox can know."""
    d = Path("/tmp") / f"sandlot-host-{uuid.uuid4().hex}"
    d.mkdir()
    f = d / "secret.txt"
    secret = f"HOST-SECRET-{uuid.uuid4().hex}".encode()
    f.write_bytes(secret)
    yield f, secret
    for p in sorted(d.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() or p.is_symlink() else p.rmdir()
    d.rmdir()


def _escapes(path_in_host: Path):
    rel = "../" * 12 + str(path_in_host).lstrip("/")
    return [rel, "/" + rel, "/workspace/" + rel, "a/../../" + rel]


def test_dotdot_read_cannot_escape(sb, host_secret):
    f, secret = host_secret
    for p in _escapes(f):
        try:
            data = sb.read_file(p)
        except (sandlot.NotFound, sandlot.InvalidArgument, sandlot.PermissionDenied):
            continue
        assert secret not in data, f"read {p!r} returned the host file"


def test_dotdot_write_and_remove_cannot_escape(sb, host_secret):
    f, secret = host_secret
    planted = f.parent / "planted.txt"
    for p in _escapes(planted):
        try:
            sb.write_file(p, b"pwned")
        except (sandlot.NotFound, sandlot.InvalidArgument, sandlot.PermissionDenied):
            pass
        assert not planted.exists(), f"write {p!r} escaped"
    for p in _escapes(f):
        try:
            sb.remove(p)
        except (sandlot.NotFound, sandlot.InvalidArgument, sandlot.PermissionDenied):
            pass
        assert f.read_bytes() == secret, f"remove {p!r} touched the host file"


def test_dotdot_list_cannot_escape(sb, host_secret):
    f, _ = host_secret
    for p in _escapes(f.parent):
        try:
            names = [e.name for e in sb.list_dir(p)]
        except (sandlot.NotFound, sandlot.InvalidArgument, sandlot.PermissionDenied):
            continue
        assert "secret.txt" not in names, f"list {p!r} showed a host directory"


def test_symlink_escapes_refused(sb, host_secret):
    f, secret = host_secret
    target = f.parent / "via-link.txt"
    sb.exec(f"ln -s {f} file-link; ln -s {f.parent} dir-link; ln -s {target} new-link; "
            f"ln -s / root-link")
    # Reading through a link that points at a host path.
    for p in ["file-link", "dir-link/secret.txt", f"root-link{f}"]:
        try:
            data = sb.read_file(p)
        except (sandlot.NotFound, sandlot.InvalidArgument, sandlot.PermissionDenied):
            continue
        assert secret not in data, f"read {p!r} followed a symlink onto the host"
    # Writing through links.
    for p in ["new-link", "dir-link/planted.txt", f"root-link{f.parent}/planted2.txt",
              "file-link"]:
        try:
            sb.write_file(p, b"pwned")
        except (sandlot.NotFound, sandlot.InvalidArgument, sandlot.PermissionDenied):
            pass
    assert not target.exists()
    assert not (f.parent / "planted.txt").exists()
    assert not (f.parent / "planted2.txt").exists()
    assert f.read_bytes() == secret
    # Listing through a link.
    try:
        names = [e.name for e in sb.list_dir("dir-link")]
    except (sandlot.NotFound, sandlot.InvalidArgument, sandlot.PermissionDenied):
        names = []
    assert "secret.txt" not in names
    # Removing through a link leaves the host file alone.
    for p in ["dir-link/secret.txt", f"root-link{f}"]:
        try:
            sb.remove(p)
        except (sandlot.NotFound, sandlot.InvalidArgument, sandlot.PermissionDenied):
            pass
    assert f.read_bytes() == secret


def test_files_of_one_sandbox_invisible_to_another(sb, make):
    sb.write_file("private.txt", "mine")
    other = make(memory_mib=64, ttl_s=60)
    with pytest.raises(sandlot.NotFound):
        other.read_file("private.txt")
    assert other.exec("cat /workspace/private.txt").exit_code != 0


def test_stat_reports_files_dirs_and_links(sb):
    sb.write_file("st/a.txt", b"12345")
    sb.exec("chmod 640 st/a.txt && ln -sf a.txt st/link")
    f = sb.stat("st/a.txt")
    assert (f.name, f.type, f.size) == ("a.txt", "file", 5)
    assert f.mode & 0o777 == 0o640 and f.mtime > 1_600_000_000
    d = sb.stat("/workspace/st")
    assert (d.name, d.type) == ("st", "dir")
    link = sb.stat("st/link")  # followed inside the sandbox
    assert (link.name, link.type, link.size) == ("link", "file", 5)
    # Where a link leads, as an absolute path inside the sandbox (E2B's symlinkTarget),
    # through a chain of links, with `..` past the root clamped to it.
    sb.exec("ln -sf /workspace/st/link st/chain && ln -sfn ../../../../workspace/st st/up"
            " && ln -sf gone st/dangling")
    assert link.link_target == "/workspace/st/a.txt"
    assert sb.stat("st/chain").link_target == "/workspace/st/a.txt"
    assert sb.stat("st/up").link_target == "/workspace/st"
    assert f.link_target is None and d.link_target is None
    entries = {e.name: e for e in sb.list_dir("st")}
    assert (entries["link"].type, entries["link"].link_target) == ("symlink", "/workspace/st/a.txt")
    assert (entries["dangling"].type, entries["dangling"].link_target) == ("symlink", None)
    assert entries["a.txt"].link_target is None
    root = sb.stat("/")
    assert (root.name, root.type) == ("/", "dir")
    with pytest.raises(sandlot.NotFound):
        sb.stat("st/missing")
    with pytest.raises(sandlot.InvalidArgument):
        sb.stat("/proc/1/status")


def test_mkdir_with_and_without_parents(sb):
    sb.mkdir("mk/a/b", parents=True)
    d = sb.stat("mk/a/b")
    assert d.type == "dir" and d.mode & 0o777 == 0o755
    sb.mkdir("mk/a/b", parents=True)  # mkdir -p of an existing directory is fine
    with pytest.raises(sandlot.Conflict):
        sb.mkdir("mk/a/b")
    with pytest.raises(sandlot.NotFound):
        sb.mkdir("mk/missing/c")
    sb.mkdir("mk/c")
    assert sorted(e.name for e in sb.list_dir("mk")) == ["a", "c"]
    # Commands in the sandbox can use what the API made.
    assert sb.exec("touch mk/a/b/x && test -d mk/c && echo ok").stdout == b"ok\n"
    sb.write_file("mk/file", "x")
    with pytest.raises(sandlot.Conflict):
        sb.mkdir("mk/file")
    with pytest.raises(sandlot.Conflict):
        sb.mkdir("mk/file", parents=True)
    with pytest.raises(sandlot.InvalidArgument):
        sb.mkdir("mk/file/sub", parents=True)
    with pytest.raises(sandlot.InvalidArgument):
        sb.mkdir("/proc/sandlot-x")
    sb.remove("mk")


def test_home_is_the_sandbox_roots(sb):
    """`/home` is the sandbox root's, like `/mnt`, `/opt`, `/srv`, `/media`: the files API
    and commands can make a user's home there (E2B's `/home/user`). Before, the image's
    `/home` refused both on `container`, whose file calls run as the sandbox's root."""
    home = f"/home/u-{uuid.uuid4().hex[:8]}"
    sb.mkdir(f"{home}/sub", parents=True)
    sb.write_file(f"{home}/sub/f", "x")
    r = sb.exec(f"cat {home}/sub/f && mkdir {home}-cmd && touch {home}-cmd/g && echo ok")
    assert r.exit_code == 0 and r.stdout == b"xok\n", r
    sb.remove(home)
    sb.remove(f"{home}-cmd")
    assert sb.exec(f"ls -d {home} {home}-cmd").exit_code != 0


def test_mkdir_dotdot_stays_inside(sb):
    name = f"sandlot-escape-{uuid.uuid4().hex}"
    sb.mkdir(f"../../../../../tmp/{name}", parents=True)
    assert not Path("/tmp", name).exists()
    assert sb.stat(f"/tmp/{name}").type == "dir"
    sb.remove(f"/tmp/{name}")
