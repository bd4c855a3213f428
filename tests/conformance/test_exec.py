"""Exec semantics (DESIGN.md, "Exec semantics"), identical on every backend."""

from __future__ import annotations

import base64
import hashlib
import os
import time
import uuid

import pytest

import sandlot
from conftest import ZOMBIES_PY, host_processes_matching, wait_until

MIB = 1 << 20


def test_echo_cwd_env_defaults(sb):
    r = sb.exec("pwd; echo $FOO", env={"FOO": "bar baz"})
    assert (r.exit_code, r.signal, r.timed_out, r.oom_killed) == (0, None, False, False)
    assert r.stdout == b"/workspace\nbar baz\n"
    assert r.stdout_bytes == len(r.stdout) and r.stderr == b"" and not r.truncated
    assert r.duration_ms > 0
    r = sb.exec(["sh", "-c", "pwd"], cwd="/tmp")
    assert r.stdout == b"/tmp\n"


def test_argv_is_not_a_shell_string(sb):
    # argv: no shell in between, metacharacters arrive as they are.
    r = sb.exec(["echo", "$HOME", "a;b", "*", "'q'"])
    assert r.exit_code == 0 and r.stdout == b"$HOME a;b * 'q'\n"
    # A shell string: /bin/sh -c expands, pipes and chains.
    r = sb.exec("X=4; echo $((X * 2)) | tr 8 9 && false || echo chained")
    assert r.exit_code == 0 and r.stdout == b"9\nchained\n"


def test_loopback_is_up(sb):
    # A server and a client on 127.0.0.1 in one sandbox, with no network policy: every
    # backend's `lo` is up (microVM guests had it down, so local servers — a Jupyter
    # kernel's ZeroMQ ports, `python3 -m http.server` — could not be reached from inside).
    prog = (
        "import socket\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
        "c = socket.create_connection(s.getsockname(), timeout=5)\n"
        "a, _ = s.accept(); c.sendall(b'ping'); print(a.recv(4).decode())\n"
    )
    r = sb.exec(["python3", "-c", prog], timeout_s=60)
    assert (r.exit_code, r.stdout) == (0, b"ping\n"), r


def test_large_program_through_stdin(sb):
    # 8 MiB of source: far past ARG_MAX (2 MiB) and MAX_ARG_STRLEN (128 KiB). The program
    # prints the digest of its own literal, so every byte must have arrived.
    data = base64.b64encode(os.urandom(6 * MIB)).decode()
    program = f"DATA = '{data}'\nimport hashlib\nprint(hashlib.sha256(DATA.encode()).hexdigest())\n"
    assert len(program) > 8 * MIB
    r = sb.exec(["python3", "-"], stdin=program, timeout_s=120)
    assert r.exit_code == 0, r
    assert r.stdout.decode().strip() == hashlib.sha256(data.encode()).hexdigest()


def test_huge_output_capped_tail_kept(sb):
    # Verbatim from the foundation issue: `seq 1 3000000; echo END >&2; exit 3`.
    r = sb.exec("seq 1 3000000; echo END >&2; exit 3", timeout_s=60)
    expected_total = sum(len(str(i)) + 1 for i in range(1, 3000001))
    assert r.exit_code == 3 and not r.timed_out
    assert r.truncated
    assert r.stdout_bytes == expected_total
    assert len(r.stdout) <= 1 * MIB + 64, len(r.stdout)  # default cap 1 MiB per stream
    assert r.stdout.startswith(b"1\n2\n3\n")
    assert r.stdout.endswith(b"2999999\n3000000\n")
    assert r.stderr == b"END\n" and r.stderr_bytes == 4


def test_max_output_bytes_is_honoured(sb):
    r = sb.exec("head -c 100000 /dev/zero", max_output_bytes=1000)
    assert r.exit_code == 0 and r.truncated and r.stdout_bytes == 100000
    assert len(r.stdout) <= 1000 and set(r.stdout) == {0}


def test_non_utf8_bytes_exact(sb):
    r = sb.exec(["python3", "-c",
                 "import sys; sys.stdout.buffer.write(bytes(range(256)));"
                 "sys.stderr.buffer.write(b'\\xff\\xfe\\x00end')"])
    assert r.exit_code == 0
    assert r.stdout == bytes(range(256))
    assert r.stderr == b"\xff\xfe\x00end"
    assert r.stdout_bytes == 256 and r.stderr_bytes == 6


def test_stdin_binary_and_text(sb):
    data = bytes(range(256)) * 1000 + b"\x00tail"
    r = sb.exec(["sh", "-c", "cat; echo; wc -c < /dev/null"], stdin=data)
    assert r.exit_code == 0 and r.stdout == data + b"\n0\n"
    r = sb.exec("read x; echo got:$x", stdin="héllo\n")
    assert r.stdout == "got:héllo\n".encode()


def test_no_stdin_means_eof_not_hang(sb):
    t0 = time.monotonic()
    r = sb.exec(["cat"], timeout_s=10)
    assert r.exit_code == 0 and not r.timed_out and r.stdout == b""
    assert time.monotonic() - t0 < 8


def test_timeout_kills_background_children(sb):
    tag = f"{uuid.uuid4().int % 900000 + 100000}"  # a sleep duration unique on this host
    cmd = (f"sleep {tag} & (sleep {tag} &) ; setsid sleep {tag} & "
           f"echo started; sleep {tag}")
    t0 = time.monotonic()
    r = sb.exec(cmd, timeout_s=1.5)
    elapsed = time.monotonic() - t0
    assert r.timed_out
    assert r.exit_code != 0
    assert elapsed < 15, f"exec returned after {elapsed:.1f}s for a 1.5 s timeout"
    assert b"started" in r.stdout  # output before the timeout is kept
    # Nothing of the tree survives, on the host (where the backend's processes are host
    # processes) or inside the sandbox.
    needle = f"sleep\x00{tag}".encode()
    wait_until(lambda: not host_processes_matching(needle), 10,
               what=f"the `sleep {tag}` processes to die")
    r2 = sb.exec("ps -ef 2>/dev/null || true; cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
    assert f"sleep {tag}" not in r2.stdout.decode(errors="replace")


def test_output_before_timeout_is_kept(sb):
    r = sb.exec("echo before; echo err-before >&2; sleep 30; echo after", timeout_s=1)
    assert r.timed_out
    assert r.stdout == b"before\n" and r.stderr == b"err-before\n"


def test_missing_command_is_127(sb):
    r = sb.exec(["no-such-command-xyz", "arg"])
    assert r.exit_code == 127 and r.signal is None and not r.timed_out
    assert r.stderr, "a command that cannot start must say why on stderr"
    r = sb.exec("no-such-command-xyz")
    assert r.exit_code == 127


def test_not_executable_is_126(sb):
    sb.write_file("exec-126/notexec.sh", "#!/bin/sh\necho hi\n")
    r = sb.exec(["./notexec.sh"], cwd="/workspace/exec-126")
    assert r.exit_code == 126 and r.stderr


@pytest.mark.parametrize("sig", [9, 15])
def test_killed_by_signal_is_128_plus_n(sb, sig):
    r = sb.exec(["sh", "-c", f"kill -{sig} $$"])
    assert r.signal == sig and r.exit_code == 128 + sig and not r.timed_out


ORPHANS = ZOMBIES_PY + r"""
import glob, os, time

def others():
    # every process of the sandbox but its init (pid 1) and us
    return {p for p in glob.glob('/proc/[0-9]*') if p not in ('/proc/1', f'/proc/{os.getpid()}')}

before = others()           # what the backend runs besides init (e.g. an exec helper)
for i in range(50):
    pid = os.fork()
    if pid == 0:
        if os.fork() == 0:      # grandchild: orphaned at once, exits soon
            time.sleep(0.05)
            os._exit(0)
        os._exit(0)
    os.waitpid(pid, 0)

# Poll (no fixed sleep): the orphans exit after 50 ms and the sandbox's init must reap
# every one of them; wait up to 20 s for them to be gone (alive or zombie), then count zombies.
deadline = time.monotonic() + 20
while others() - before and time.monotonic() < deadline:
    time.sleep(0.05)
print(zombies())
"""


def test_orphans_leave_no_zombies(sb):
    r = sb.exec(["python3", "-c", ORPHANS], timeout_s=30)
    assert r.exit_code == 0, r
    assert r.stdout == b"0\n", f"zombies left in the sandbox: {r.stdout!r}"


def test_streaming_yields_chunks_then_result(sb):
    events = []
    t0 = time.monotonic()
    for ev in sb.exec_stream("for i in 1 2 3; do echo $i; sleep 0.6; done; "
                             "printf '\\377' >&2; exit 4", timeout_s=30):
        events.append((time.monotonic() - t0, ev))
    assert isinstance(events[-1][1], sandlot.ExecResult)
    assert all(not isinstance(e, sandlot.ExecResult) for _, e in events[:-1])
    result = events[-1][1]
    out = b"".join(e.data for _, e in events if isinstance(e, sandlot.StdoutChunk))
    err = b"".join(e.data for _, e in events if isinstance(e, sandlot.StderrChunk))
    assert out == b"1\n2\n3\n" and err == b"\xff"
    assert result.exit_code == 4 and result.stdout_bytes == 6 and result.stderr_bytes == 1
    # The first chunk came while the command was still running (real streaming).
    first = next(t for t, e in events if isinstance(e, sandlot.StdoutChunk))
    assert first < events[-1][0] - 0.5, [(round(t, 2), e) for t, e in events]


def test_bad_cwd_is_invalid_argument(sb):
    with pytest.raises(sandlot.InvalidArgument):
        sb.exec("true", cwd="/no/such/dir")
