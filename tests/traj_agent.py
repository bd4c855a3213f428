#!/usr/bin/env python3
"""An agent-like loop of 30 non-idempotent steps on a trajectory sandbox, for the
kill-and-rerun test of tests/test_trajectory.py (run as its own process, like a trainer).

Usage: traj_agent.py URL TRAJECTORY

Prints one JSON line per event on stdout, flushed at once:
    {"event": "sandbox", "id": "sb-...", "reattached": bool}
    {"event": "step", "i": N, "kind": "...", "replayed": bool, "obs": {...} | null}
    {"event": "done"}
Env ``SANDLOT_AGENT_KILL_AFTER=K``: SIGKILL itself right after printing step K (a
pre-arranged crash, no cleanup, no atexit). Rerunning with the same TRAJECTORY replays the
loop from step 0: with the trajectory log every step already acknowledged comes back
``replayed`` and nothing runs twice; without it, `mkdir` fails, appends double, and the
"commit" chain forks.

The steps (see :func:`steps`): appends to /workspace/counter, `mkdir` without -p, file
writes, a python "commit" that chains hashes (HEAD changes every time it runs, like
`git commit`; the python image has no git), file removes and observations of the state.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "sdk" / "python"))

import sandlot  # noqa: E402

N_STEPS = 30

COMMIT_PY = r"""
import hashlib, os
os.makedirs('/workspace/objects', exist_ok=True)
head = open('/workspace/HEAD').read() if os.path.exists('/workspace/HEAD') else '0' * 64
notes = sorted(os.listdir('/workspace/notes')) if os.path.isdir('/workspace/notes') else []
tree = ''.join(n + ':' + open('/workspace/notes/' + n).read() for n in notes)
h = hashlib.sha256((head + tree).encode()).hexdigest()
open('/workspace/objects/' + h, 'x').write(head + '\n' + tree)
open('/workspace/HEAD', 'w').write(h)
open('/workspace/commits.log', 'a').write(h + '\n')
print(h, len(notes))
"""


def steps() -> List[Tuple[str, tuple]]:
    """The 30 steps as (kind, args): kind ``append`` | ``mkdir`` | ``write`` | ``commit`` |
    ``observe`` | ``remove``."""
    out: List[Tuple[str, tuple]] = []
    for i in range(N_STEPS):
        if i % 10 == 9:
            out.append(("remove", (f"notes/n{i - 7}.txt",)))
        elif i % 10 == 4:
            out.append(("observe", ()))
        elif i % 5 == 0:
            out.append(("append", (i,)))
        elif i % 5 == 1:
            out.append(("mkdir", (f"/workspace/d{i}",)))
        elif i % 5 == 2:
            out.append(("write", (f"notes/n{i}.txt", f"note {i}\n")))
        else:
            out.append(("commit", ()))
    return out


def append_steps() -> List[int]:
    """Indices of the append steps, i.e. the lines /workspace/counter must hold, in order."""
    return [args[0] for kind, args in steps() if kind == "append"]


def run_step(sb: sandlot.Sandbox, kind: str, args: tuple):
    if kind == "write":
        sb.write_file(args[0], args[1])
        return None, sb.last_replayed
    if kind == "remove":
        sb.remove(args[0])
        return None, sb.last_replayed
    if kind == "append":
        r = sb.exec(f"echo {args[0]} >> /workspace/counter")
    elif kind == "mkdir":
        r = sb.exec(["mkdir", args[0]])
    elif kind == "commit":
        r = sb.exec(["python3", "-c", COMMIT_PY])
    elif kind == "observe":
        r = sb.exec("wc -l < /workspace/counter; ls /workspace; cat /workspace/HEAD")
    else:
        raise ValueError(kind)
    obs = {"exit_code": r.exit_code, "stdout": r.stdout.decode("utf-8", "replace"),
           "stderr": r.stderr.decode("utf-8", "replace")}
    return obs, r.replayed


def main() -> int:
    url, trajectory = sys.argv[1], sys.argv[2]
    kill_after = os.environ.get("SANDLOT_AGENT_KILL_AFTER")
    kill_at = int(kill_after) if kill_after else None
    client = sandlot.Client(url, timeout=60, retries=5)

    def emit(d) -> None:
        sys.stdout.write(json.dumps(d, sort_keys=True) + "\n")
        sys.stdout.flush()

    sb = client.create(image="python", memory_mib=128, ttl_s=600, trajectory=trajectory,
                       labels={"test": "traj-kill-rerun"})
    emit({"event": "sandbox", "id": sb.id, "reattached": sb.reattached})
    for i, (kind, args) in enumerate(steps()):
        assert sb.next_step == i, (sb.next_step, i)
        obs, replayed = run_step(sb, kind, args)
        emit({"event": "step", "i": i, "kind": kind, "replayed": replayed, "obs": obs})
        if kill_at is not None and i == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    emit({"event": "done"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
