"""Sandlot's code-interpreter bridge: one stateful Jupyter kernel per process, driven over
stdin/stdout by the server (crates/sandlot-server/src/e2b/interpreter.rs), which speaks
E2B's code-interpreter protocol (`POST /execute`, NDJSON) to the `e2b-code-interpreter` SDK.

Run inside the sandbox: python3 bridge.py (cwd = the context's working directory). Needs
ipykernel and jupyter_client (the lang-python image has them).

stdin, one JSON object per line:
  {"id": N, "code": str, "env_vars": {str: str} | null}   run one cell
  {"interrupt": N}                                         interrupt cell N if it runs
stdout (the server's), one JSON object per line:
  {"ready": true}                       once, when the kernel answers
  {"fatal": str}                        the kernel could not start (then exit 1)
  {"id": N, "out": {...}}               one E2B output line: {"type": "stdout"|"stderr",
                                        "text", "timestamp"}, {"type": "result", "text",
                                        "png", "html", ..., "is_main_result", "extra"},
                                        {"type": "error", "name", "value", "traceback"},
                                        {"type": "number_of_executions", "execution_count"}
  {"id": N, "done": true}               cell N finished (after all its output)
A kernel that dies during a cell gets the cell an error `DeadKernelError` and is restarted
(fresh state). The kernel's own stdout/stderr go to /dev/null (its output reaches us as
Jupyter messages), so nothing but this script writes the protocol stream.
"""

import asyncio
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
import time

# The protocol streams are private copies of fds 0 and 1; the kernel (a child) inherits
# /dev/null instead, so a subprocess of a cell cannot write into the protocol.
PROTO_IN = os.fdopen(os.dup(0), "rb", buffering=0)
PROTO_OUT = os.fdopen(os.dup(1), "w", buffering=1)
_null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1):
    os.dup2(_null, fd)
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]


def send(obj):
    PROTO_OUT.write(json.dumps(obj) + "\n")
    PROTO_OUT.flush()


try:
    from jupyter_client.manager import AsyncKernelManager
except ImportError as e:
    send({"fatal": f"python3 cannot import jupyter_client ({e}); install ipykernel and "
                   "jupyter_client in the image"})
    sys.exit(1)
if importlib.util.find_spec("ipykernel") is None:
    send({"fatal": "python3 has no ipykernel; install ipykernel in the image"})
    sys.exit(1)
os.dup2(_null, 2)

# MIME types E2B's Result has a field for (anything else goes to `extra`).
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}
ALIVE_POLL_S = 0.2

ENV_HELPERS = """
def __sandlot_setenv(new):
    import os
    old = {k: os.environ.get(k) for k in new}
    os.environ.update(new)
    return old
def __sandlot_restoreenv(old):
    import os
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
"""


def result_of(data, main):
    out = {"type": "result", "is_main_result": main}
    extra = {}
    for mime, value in data.items():
        field = MIME_FIELDS.get(mime)
        if field:
            out[field] = value
        else:
            extra[mime] = value
    text = out.get("text")
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] == "'":
        out["text"] = text[1:-1]
    if extra:
        out["extra"] = extra
    return out


class Kernel:
    def __init__(self):
        self.km = None
        self.kc = None
        self.sockets = None

    async def start(self):
        # ZeroMQ over Unix sockets in a private directory, not TCP on 127.0.0.1: no port of
        # the sandbox is taken, and nothing depends on the sandbox's loopback interface.
        self.sockets = tempfile.mkdtemp(prefix="sandlot-kernel-")
        self.km = AsyncKernelManager(kernel_name="python3", transport="ipc",
                                     ip=os.path.join(self.sockets, "k"))
        await self.km.start_kernel(cwd=os.getcwd())
        self.kc = self.km.client()
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=60)
        await self.run_silent(ENV_HELPERS)

    async def stop(self):
        if self.kc:
            self.kc.stop_channels()
        if self.km:
            try:
                await self.km.shutdown_kernel(now=True)
            except Exception:
                pass
        if self.sockets:
            shutil.rmtree(self.sockets, ignore_errors=True)

    async def run_silent(self, code):
        await self.kc.execute_interactive(code, silent=True, store_history=False,
                                          output_hook=lambda _m: None, timeout=60)

    async def run(self, rid, code, env_vars):
        """Runs one cell, sending its output; returns False when the kernel died."""
        errored = [False]

        def hook(msg):
            kind = msg["header"]["msg_type"]
            c = msg["content"]
            if kind == "stream":
                name = c.get("name")
                if name in ("stdout", "stderr"):
                    send({"id": rid, "out": {"type": name, "text": c.get("text", ""),
                                             "timestamp": time.time_ns()}})
            elif kind in ("display_data", "execute_result"):
                send({"id": rid, "out": result_of(c.get("data", {}),
                                                  kind == "execute_result")})
            elif kind == "error" and not errored[0]:
                errored[0] = True
                send({"id": rid, "out": {"type": "error", "name": c.get("ename", ""),
                                         "value": c.get("evalue", ""),
                                         "traceback": "\n".join(c.get("traceback", []))}})

        if env_vars:
            literal = json.dumps(json.dumps(env_vars))  # a Python string literal
            await self.run_silent(
                f"__sandlot_env_old = __sandlot_setenv(__import__('json').loads({literal}))")
        task = asyncio.ensure_future(self.kc.execute_interactive(
            code, store_history=True, allow_stdin=False, output_hook=hook, timeout=None))
        alive = True
        while True:
            done, _ = await asyncio.wait({task}, timeout=ALIVE_POLL_S)
            if done:
                reply = task.result()
                count = reply.get("content", {}).get("execution_count")
                if isinstance(count, int):
                    send({"id": rid, "out": {"type": "number_of_executions",
                                             "execution_count": count}})
                break
            if not await self.km.is_alive():
                task.cancel()
                alive = False
                send({"id": rid, "out": {"type": "error", "name": "DeadKernelError",
                                         "value": "the kernel died while running this cell; "
                                                  "it was restarted (variables are gone)",
                                         "traceback": ""}})
                break
        if alive and env_vars:
            await self.run_silent("__sandlot_restoreenv(__sandlot_env_old)")
        return alive


def reader(loop, queue):
    for line in PROTO_IN:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        loop.call_soon_threadsafe(queue.put_nowait, msg)
    loop.call_soon_threadsafe(queue.put_nowait, None)


async def main():
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    kernel = Kernel()
    try:
        await kernel.start()
    except Exception as e:  # noqa: BLE001 - reported to the server, then exit
        send({"fatal": f"{type(e).__name__}: {e}"})
        sys.exit(1)
    send({"ready": True})
    loop = asyncio.get_running_loop()
    queue = asyncio.Queue()
    threading.Thread(target=reader, args=(loop, queue), daemon=True).start()
    pending = []
    while True:
        msg = pending.pop(0) if pending else await queue.get()
        if msg is None:
            break
        if "code" not in msg:
            continue  # an interrupt for a cell that is not running
        rid = msg.get("id")
        run = asyncio.ensure_future(kernel.run(rid, msg["code"], msg.get("env_vars")))
        while not run.done():
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({run, getter}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                other = getter.result()
                if other is not None and other.get("interrupt") == rid:
                    await kernel.km.interrupt_kernel()
                else:
                    pending.append(other)
            else:
                getter.cancel()
        try:
            alive = run.result()
        except Exception as e:  # noqa: BLE001 - the cell's failure, reported as its error
            alive = await kernel.km.is_alive()
            send({"id": rid, "out": {"type": "error", "name": type(e).__name__,
                                     "value": str(e), "traceback": ""}})
        if not alive:
            await kernel.stop()
            kernel = Kernel()
            await kernel.start()
        send({"id": rid, "done": True})
    await kernel.stop()


if __name__ == "__main__":
    asyncio.run(main())
