"""Sandlot's `run_jupyter` driver, run with python3 inside the sandbox (lang-python image).

Usage: python3 driver.py INPUT.json OUTPUT.json

INPUT: {"kernel": "python3", "cells": [str], "cell_timeout": s (0 = none),
        "total_timeout": s}
OUTPUT: {"status": "Finished" | "TimeLimitExceeded", "cells": [{"stdout", "stderr",
         "display": [mime bundle], "error": [{"ename", "evalue", "traceback"}]}]}
Cells run in order in one kernel; a cell that raises is recorded and the next one runs (as
in a notebook run by SandboxFusion). A cell over its limit (the smaller of cell_timeout and
what is left of total_timeout) ends the run: it gets an error `TimeoutError` and
status is TimeLimitExceeded. OUTPUT is written before the kernel is shut down.
"""

import asyncio
import json
import sys
import time

from jupyter_client.manager import AsyncKernelManager


def new_cell():
    return {"stdout": "", "stderr": "", "display": [], "error": []}


async def run(cfg, out_path):
    cells = []
    status = "Finished"
    km = AsyncKernelManager(kernel_name=cfg["kernel"])
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=max(cfg["total_timeout"], 1))
        deadline = time.monotonic() + cfg["total_timeout"]
        for code in cfg["cells"]:
            cell = new_cell()
            cells.append(cell)

            def hook(msg, cell=cell):
                kind = msg["header"]["msg_type"]
                content = msg["content"]
                if kind == "stream" and content.get("name") in ("stdout", "stderr"):
                    cell[content["name"]] += content["text"]
                elif kind in ("display_data", "execute_result"):
                    cell["display"].append(content["data"])
                elif kind == "error":
                    cell["error"].append({k: content.get(k) for k in ("ename", "evalue", "traceback")})

            left = deadline - time.monotonic()
            limit = min(left, cfg["cell_timeout"]) if cfg["cell_timeout"] > 0 else left
            try:
                if limit <= 0:
                    raise TimeoutError
                await kc.execute_interactive(code, output_hook=hook, timeout=limit)
            except TimeoutError:
                status = "TimeLimitExceeded"
                cell["error"].append({
                    "ename": "TimeoutError",
                    "evalue": f"cell did not finish within {max(limit, 0):.3f} s",
                    "traceback": [],
                })
                break
        with open(out_path, "w") as f:
            json.dump({"status": status, "cells": cells}, f)
    finally:
        kc.stop_channels()
        # The sandbox, and the kernel with it, is deleted right after: no graceful shutdown.
        try:
            await km.shutdown_kernel(now=True)
        except Exception as e:  # noqa: BLE001 - the answer is already written
            print(f"kernel shutdown: {e}", file=sys.stderr)


def main():
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    asyncio.run(run(cfg, sys.argv[2]))


if __name__ == "__main__":
    main()
