"""Sandlot's `run_jupyter` driver, run with python3 inside the sandbox (lang-python image).

Usage: python3 driver.py INPUT.json OUTPUT.json

INPUT: {"kernel": "python3", "cells": [str], "cell_timeout": s (0 = none),
        "total_timeout": s}
OUTPUT: {"status": "Finished" | "TimeLimitExceeded", "cells": [{"stdout", "stderr",
         "display": [mime bundle], "error": [{"ename", "evalue", "traceback"}]}]}
Cells run in order in one kernel; a cell that raises is recorded and the next one runs (as
in a notebook run by SandboxFusion). A cell over its limit (the smaller of cell_timeout and
what is left of total_timeout) ends the run: it gets an error `TimeoutError` and
status is TimeLimitExceeded. A kernel that dies during a cell (os._exit, a segfault, the OOM
killer) ends the run at once: the cell gets an error `DeadKernelError` and status is
KernelDied (not a wait for the time limit). Output is bounded so that what a cell prints
cannot take the driver down or push OUTPUT past what the server fetches: each cell's
stdout and stderr keep their first MAX_STREAM characters, and the MIME bundles of all cells
together at most MAX_DISPLAY characters (later ones are dropped); a cut is noted at the
end of that cell's stderr.
"""

import asyncio
import ctypes
import json
import os
import shutil
import signal
import sys
import time

# The cells run arbitrary code as the same user as this driver. So that they cannot forge
# OUTPUT (the server trusts it): no one may ptrace this process or read its memory, the
# driver imports nothing from its own (writable) directory, and before OUTPUT is written
# every other process of the sandbox is killed (see `kill_the_rest`).
PR_SET_DUMPABLE = 4
ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

from jupyter_client.manager import AsyncKernelManager


# Characters kept per cell and stream (as run_code keeps 1 MiB per stream).
MAX_STREAM = 1 << 20
# Characters of MIME bundles kept over all cells (the server fetches at most 64 MiB per call).
MAX_DISPLAY = 32 << 20
# Seconds between checks that the kernel is still alive while a cell runs.
ALIVE_POLL_S = 0.2


def new_cell():
    return {"stdout": "", "stderr": "", "display": [], "error": []}


def others():
    """Pids of the sandbox's processes other than this one and its init (pid 1)."""
    me = os.getpid()
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]


def kill_the_rest():
    """SIGKILL every other process of the sandbox (the kernel and whatever the cells left
    running, e.g. a detached process waiting to overwrite OUTPUT) and wait until they are
    gone, so nothing but this driver can touch OUTPUT once it is written."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while True:  # reap the kernel (our child) and any other child
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        left = []
        for pid in others():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        left.append(pid)
            except OSError:
                pass
        if not left:
            return
        time.sleep(0.01)
    raise RuntimeError(f"processes {left} survived SIGKILL")


def write_output(out_path, answer):
    """Write OUTPUT atomically, replacing whatever a cell left at that path."""
    tmp = out_path + ".tmp"
    for p in (tmp, out_path):
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)
    with open(tmp, "w") as f:
        json.dump(answer, f)
    os.rename(tmp, out_path)


def note(cell, text):
    cell.setdefault("_notes", [])
    if text not in cell["_notes"]:
        cell["_notes"].append(text)


# Printed once the kernel answers; the server looks for it (jupyter.rs KERNEL_READY).
KERNEL_READY = "sandlot-jupyter: kernel ready"


async def run(cfg, out_path):
    cells = []
    status = "Finished"
    display_left = [MAX_DISPLAY]
    km = AsyncKernelManager(kernel_name=cfg["kernel"])
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=max(cfg["total_timeout"], 1))
        # From here a driver that dies without its answer was killed by the cells (the
        # server answers Failed, not SandboxError); a cell can add text to this stream but
        # cannot take this line back.
        print(KERNEL_READY, flush=True)
        deadline = time.monotonic() + cfg["total_timeout"]
        for code in cfg["cells"]:
            cell = new_cell()
            cells.append(cell)

            def hook(msg, cell=cell):
                kind = msg["header"]["msg_type"]
                content = msg["content"]
                if kind == "stream" and content.get("name") in ("stdout", "stderr"):
                    name = content["name"]
                    room = MAX_STREAM - len(cell[name])
                    if len(content["text"]) > room:
                        note(cell, f"[sandlot: {name} cut at {MAX_STREAM} characters]")
                    if room > 0:
                        cell[name] += content["text"][:room]
                elif kind in ("display_data", "execute_result"):
                    size = len(json.dumps(content["data"]))
                    if size > display_left[0]:
                        note(cell, f"[sandlot: display output over {MAX_DISPLAY} characters"
                                   " dropped]")
                    else:
                        display_left[0] -= size
                        cell["display"].append(content["data"])
                elif kind == "error":
                    cell["error"].append({k: content.get(k) for k in ("ename", "evalue", "traceback")})

            left = deadline - time.monotonic()
            limit = min(left, cfg["cell_timeout"]) if cfg["cell_timeout"] > 0 else left
            try:
                if limit <= 0:
                    raise TimeoutError
                run = asyncio.ensure_future(
                    kc.execute_interactive(code, output_hook=hook, timeout=limit)
                )
                while True:
                    done, _ = await asyncio.wait({run}, timeout=ALIVE_POLL_S)
                    if done:
                        run.result()
                        break
                    if not await km.is_alive():
                        run.cancel()
                        status = "KernelDied"
                        cell["error"].append({
                            "ename": "DeadKernelError",
                            "evalue": "the kernel died while running this cell",
                            "traceback": [],
                        })
                        break
                if status == "KernelDied":
                    break
            except TimeoutError:
                status = "TimeLimitExceeded"
                cell["error"].append({
                    "ename": "TimeoutError",
                    "evalue": f"cell did not finish within {max(limit, 0):.3f} s",
                    "traceback": [],
                })
                break
        for cell in cells:
            for text in cell.pop("_notes", []):
                sep = "\n" if cell["stderr"] and not cell["stderr"].endswith("\n") else ""
                cell["stderr"] += sep + text + "\n"
    finally:
        kc.stop_channels()
        # The sandbox, and the kernel with it, is deleted right after: no graceful shutdown.
        kill_the_rest()
    write_output(out_path, {"status": status, "cells": cells})


def main():
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    asyncio.run(run(cfg, sys.argv[2]))


if __name__ == "__main__":
    main()
