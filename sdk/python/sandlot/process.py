"""Background processes: ``Sandbox.spawn`` → :class:`Process` (sync) and
``AsyncSandbox.spawn`` → :class:`AsyncProcess`.

A process lives in the server, not in the client: any client that knows its handle
(``Sandbox.process(pid)``, e.g. after a trainer restart) can wait for it, signal it, feed its
stdin and read its output from byte offsets. Wire types: ``crates/sandlot-api/src/process.rs``;
routes: ``docs/api.md`` ("Background processes").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, AsyncIterator, Dict, Iterator, List, Mapping, Optional,
                    Tuple, Union)

import httpx

from . import _base
from .errors import ERROR_CLASSES, Conflict, ProtocolError, SandlotError, TransportError
from .models import (Command, Data, ExecResult, StderrChunk, StdoutChunk, _exact, exec_body,
                     to_bytes)

if TYPE_CHECKING:  # pragma: no cover
    from .aio import AsyncSandbox
    from .client import Sandbox

#: A signal: name (``"SIGTERM"``, ``"TERM"``) or Linux number (``15``).
Signal = Union[str, int]

#: Longest single ``wait`` call the server accepts, seconds; longer waits loop.
_MAX_WAIT_S = 300.0


@dataclass
class OutputSkipped:
    """Bytes ``[from_, to)`` of ``stream`` (``"stdout"``/``"stderr"``) were no longer
    retained by the server when read (it keeps the last ``max_output_bytes`` per stream)."""

    stream: str
    from_: int
    to: int


#: One item of :meth:`Process.output`: chunks (``.data`` bytes), :class:`OutputSkipped`, and
#: last, once the process ended, its :class:`ExecResult` (empty ``stdout``/``stderr``).
OutputEvent = Union[StdoutChunk, StderrChunk, OutputSkipped, ExecResult]


def spawn_body(cmd: Command, cwd: Optional[str], env: Optional[Mapping[str, str]],
               stdin: Optional[Data], stdin_open: bool, timeout_s: Optional[float],
               max_output_bytes: Optional[int],
               pty: Optional[Tuple[int, int]] = None) -> Dict[str, Any]:
    """JSON body of ``POST /v1/sandboxes/{id}/processes``; ``pty`` is ``(rows, cols)``."""
    body = exec_body(cmd, cwd, env, stdin, timeout_s, max_output_bytes)
    if stdin_open:
        body["stdin"] = True
    if pty is not None:
        rows, cols = pty
        body["pty"] = {"rows": int(rows), "cols": int(cols)}
    return body


#: The command of :meth:`Sandbox.pty` by default: an interactive bash where the image has
#: one, else an interactive ``sh``.
DEFAULT_PTY_CMD = ["/bin/sh", "-c",
                   "if [ -x /bin/bash ]; then exec /bin/bash -i; fi; exec /bin/sh -i"]


def signal_body(sig: Signal) -> Dict[str, Any]:
    """JSON body of ``POST …/processes/{pid}/signal``."""
    if isinstance(sig, bool) or not isinstance(sig, (str, int)):
        raise TypeError("signal must be a name like 'SIGTERM' or a number like 15")
    return {"signal": sig}


def _error_of(err: Mapping[str, Any]) -> SandlotError:
    code = str(err.get("code", "internal"))
    cls = ERROR_CLASSES.get(code, SandlotError)
    return cls(str(err.get("message", "")), code=code if cls is SandlotError else None)


class _Fields:
    """Fields of the wire ``Process`` shared by the sync and async handles.

    Attributes:
        id: handle, ``pr-`` + 20 hex digits.   sandbox_id: its sandbox.
        cmd: the command as given.   state: ``"running"`` or ``"exited"``.
        started_at / ended_at: RFC 3339 UTC (``ended_at`` None while running).
        stdin_open: stdin accepts :meth:`write_stdin`.
        stdout_bytes / stderr_bytes: bytes written so far.
        result: :class:`ExecResult` once exited (``stdout``/``stderr`` empty; read them with
            ``output``), else None.
        error: the :class:`SandlotError` when Sandlot could not run it, else None.
        stdout_offset / stderr_offset: where this object's next ``output`` call starts
            (advanced as chunks are read; a fresh object starts at 0).
    """

    id: str
    sandbox_id: str
    state: str
    result: Optional[ExecResult]
    error: Optional[SandlotError]

    def _init_offsets(self) -> None:
        self.stdout_offset = 0
        self.stderr_offset = 0

    def _update(self, d: Mapping[str, Any]) -> None:
        try:
            self.id = str(d["id"])
            self.sandbox_id = str(d["sandbox_id"])
            self.cmd = d.get("cmd")
            self.state = str(d["state"])
            self.started_at = d.get("started_at")
            self.ended_at = d.get("ended_at")
            self.stdin_open = bool(d.get("stdin_open", False))
            self.stdout_bytes = int(d.get("stdout_bytes", 0))
            self.stderr_bytes = int(d.get("stderr_bytes", 0))
            r = d.get("result")
            self.result = ExecResult.from_json(r) if r else None
            e = d.get("error")
            self.error = _error_of(e) if e else None
        except (KeyError, TypeError, ValueError) as ex:
            raise ProtocolError(f"bad Process {dict(d)!r:.300}: {ex}") from ex

    @property
    def running(self) -> bool:
        """True while the process runs (as of the last answer from the server)."""
        return self.state == "running"

    def _parse(self, line: Union[str, bytes]) -> OutputEvent:
        """One NDJSON line of ``…/output``; advances the offsets."""
        import json
        try:
            ev = json.loads(line)
            kind = ev["type"]
        except (ValueError, KeyError, TypeError) as e:
            raise ProtocolError(f"bad process output line {line!r:.300}: {e}") from e
        if kind in ("stdout", "stderr"):
            data = _exact(ev.get("data"), ev.get("data_b64"))
            end = int(ev.get("offset", 0)) + len(data)
            if kind == "stdout":
                self.stdout_offset = end
                return StdoutChunk(data)
            self.stderr_offset = end
            return StderrChunk(data)
        if kind == "skipped":
            if ev["stream"] == "stdout":
                self.stdout_offset = int(ev["to"])
            else:
                self.stderr_offset = int(ev["to"])
            return OutputSkipped(str(ev["stream"]), int(ev["from"]), int(ev["to"]))
        if kind == "exit":
            res = ExecResult.from_json(ev["result"])
            self.state, self.result = "exited", res
            return res
        if kind == "error":
            raise _error_of(ev.get("error") or {})
        raise ProtocolError(f"unknown process output event type {kind!r}")

    def _output_params(self, follow: bool, stdout_offset: Optional[int],
                       stderr_offset: Optional[int]) -> Dict[str, Any]:
        return {
            "stdout_offset": self.stdout_offset if stdout_offset is None else int(stdout_offset),
            "stderr_offset": self.stderr_offset if stderr_offset is None else int(stderr_offset),
            "follow": "true" if follow else "false",
        }

    def _finish(self, out: bytes, err: bytes) -> ExecResult:
        if self.error is not None:
            raise self.error
        assert self.result is not None
        r = self.result
        return ExecResult(exit_code=r.exit_code, signal=r.signal, timed_out=r.timed_out,
                          oom_killed=r.oom_killed, duration_ms=r.duration_ms, stdout=out,
                          stderr=err, stdout_bytes=r.stdout_bytes, stderr_bytes=r.stderr_bytes,
                          truncated=r.truncated)

    def __repr__(self) -> str:
        return f"<Process {self.id} {self.state} in {self.sandbox_id}>"


def _collect(events: Any) -> tuple:
    out, err = bytearray(), bytearray()
    for ev in events:
        if isinstance(ev, StdoutChunk):
            out += ev.data
        elif isinstance(ev, StderrChunk):
            err += ev.data
    return bytes(out), bytes(err)


class Process(_Fields):
    """Handle of a background process (from :meth:`Sandbox.spawn`, :meth:`Sandbox.process`,
    :meth:`Sandbox.processes`). Methods raise :class:`SandlotError` subclasses: NotFound (the
    handle or its sandbox is gone, also after a server restart), Conflict (signal or stdin
    on an exited process, stdin not open)."""

    def __init__(self, sandbox: "Sandbox", data: Mapping[str, Any]) -> None:
        self._sb = sandbox
        self._init_offsets()
        self._update(data)

    def _path(self, suffix: str = "") -> str:
        return self._sb._path(f"/processes/{self.id}{suffix}")

    def refresh(self) -> "Process":
        """Reload the record from the server."""
        self._update(_base.json_of(self._sb._client._request("GET", self._path())))
        return self

    def wait(self, timeout: Optional[float] = None) -> Optional[ExecResult]:
        """Wait until the process ends (at most ``timeout`` seconds; None: no limit) and
        return its :class:`ExecResult` with the retained stdout/stderr (the last
        ``max_output_bytes`` of each), or None when it still runs at the timeout.
        Raises the process's error when Sandlot could not run it."""
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        while True:
            left = _MAX_WAIT_S if deadline is None else max(0.0, deadline - time.monotonic())
            t = min(left, _MAX_WAIT_S)
            resp = self._sb._client._request("POST", self._path("/wait"),
                                             params={"timeout_s": t}, work_s=t)
            self._update(_base.json_of(resp))
            if not self.running:
                out, err = _collect(self._events(False, 0, 0, track=False))
                return self._finish(out, err)
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def output(self, follow: bool = True, stdout_offset: Optional[int] = None,
               stderr_offset: Optional[int] = None) -> Iterator[OutputEvent]:
        """Yield the output from this object's offsets (or the ones given): chunks as
        :class:`StdoutChunk` / :class:`StderrChunk` (``.data`` bytes), an
        :class:`OutputSkipped` when older bytes were dropped, and last the
        :class:`ExecResult` once the process ended. ``follow=False`` stops after what is
        retained now. Offsets advance as chunks are read, so a later call (or, after a
        crash, a new object given the saved offsets) continues where this one stopped."""
        return self._events(follow, stdout_offset, stderr_offset, track=True)

    def _events(self, follow: bool, stdout_offset: Optional[int],
                stderr_offset: Optional[int], track: bool) -> Iterator[OutputEvent]:
        saved = (self.stdout_offset, self.stderr_offset)
        params = self._output_params(follow, stdout_offset, stderr_offset)
        timeout = httpx.Timeout(None, connect=min(self._sb._client.timeout, 30.0))
        path = self._path("/output")
        try:
            with self._sb._client._http.stream("GET", path, params=params,
                                               timeout=timeout) as resp:
                if not resp.is_success:
                    resp.read()
                    _base.check(resp)
                for line in resp.iter_lines():
                    if line.strip():
                        yield self._parse(line)
        except httpx.HTTPError as e:
            raise TransportError(f"GET {path}: {e!r}") from e
        finally:
            if not track:
                self.stdout_offset, self.stderr_offset = saved

    def signal(self, sig: Signal) -> None:
        """Send a signal: SIGKILL (``"KILL"``, 9) ends the whole process tree; the others
        (HUP INT QUIT ABRT USR1 USR2 ALRM TERM CONT TSTP WINCH) go to the command's process
        group. Raises Conflict when it already exited, InvalidArgument for other signals."""
        self._sb._client._request("POST", self._path("/signal"), json=signal_body(sig))

    def kill(self) -> None:
        """SIGKILL the whole process tree; no error when it already exited."""
        try:
            self.signal("SIGKILL")
        except Conflict:
            pass

    def write_stdin(self, data: Data, eof: bool = False) -> None:
        """Write to stdin (started with ``stdin_open=True``); ``eof=True`` closes it after.
        Raises Conflict when stdin is not open, DeadlineExceeded when the process has not
        read its stdin for 10 s, PayloadTooLarge over 1 MiB per call."""
        params = {"eof": "true"} if eof else {}
        self._sb._client._request("POST", self._path("/stdin"), params=params,
                                  content=to_bytes(data),
                                  headers={"Content-Type": "application/octet-stream"})

    def close_stdin(self) -> None:
        """Close stdin (the command reads EOF)."""
        self.write_stdin(b"", eof=True)

    def write(self, data: Data) -> None:
        """Type ``data`` into the terminal (a process started with ``pty``; as
        :meth:`write_stdin` for the others)."""
        self.write_stdin(data)

    def resize(self, rows: int, cols: int) -> None:
        """Resize the terminal of a process started with ``pty`` (its foreground process
        group gets SIGWINCH). Raises InvalidArgument without a terminal or for a size out
        of 1..1000, Conflict when it already exited."""
        self._sb._client._request("POST", self._path("/resize"),
                                  json={"rows": int(rows), "cols": int(cols)})

    def read(self, timeout: float = 0.0) -> bytes:
        """The output (a terminal's: its whole output) that came since the last read,
        waiting up to ``timeout`` seconds for some; ``b""`` when none came (or the process
        ended and everything was read). Advances :attr:`stdout_offset`."""
        deadline = time.monotonic() + float(timeout)
        while True:
            got = bytearray()
            for ev in self._events(False, None, None, track=True):
                if isinstance(ev, StdoutChunk):
                    got.extend(ev.data)
            if got or time.monotonic() >= deadline:
                return bytes(got)
            self.refresh()
            if not self.running and self.stdout_offset >= self.stdout_bytes:
                return b""
            time.sleep(0.05)

    def delete(self) -> None:
        """Kill the whole tree and forget the handle (NotFound afterwards)."""
        self._sb._client._request("DELETE", self._path())


class AsyncProcess(_Fields):
    """:class:`Process` for :class:`~sandlot.AsyncSandbox`: the same methods as coroutines
    (``output`` is an async iterator)."""

    def __init__(self, sandbox: "AsyncSandbox", data: Mapping[str, Any]) -> None:
        self._sb = sandbox
        self._init_offsets()
        self._update(data)

    def _path(self, suffix: str = "") -> str:
        return self._sb._path(f"/processes/{self.id}{suffix}")

    async def refresh(self) -> "AsyncProcess":
        """Reload the record from the server."""
        self._update(_base.json_of(await self._sb._client._request("GET", self._path())))
        return self

    async def wait(self, timeout: Optional[float] = None) -> Optional[ExecResult]:
        """As :meth:`Process.wait`."""
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        while True:
            left = _MAX_WAIT_S if deadline is None else max(0.0, deadline - time.monotonic())
            t = min(left, _MAX_WAIT_S)
            resp = await self._sb._client._request("POST", self._path("/wait"),
                                                   params={"timeout_s": t}, work_s=t)
            self._update(_base.json_of(resp))
            if not self.running:
                out, err = bytearray(), bytearray()
                async for ev in self._events(False, 0, 0, track=False):
                    if isinstance(ev, StdoutChunk):
                        out += ev.data
                    elif isinstance(ev, StderrChunk):
                        err += ev.data
                return self._finish(bytes(out), bytes(err))
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def output(self, follow: bool = True, stdout_offset: Optional[int] = None,
               stderr_offset: Optional[int] = None) -> AsyncIterator[OutputEvent]:
        """As :meth:`Process.output`, an async iterator."""
        return self._events(follow, stdout_offset, stderr_offset, track=True)

    async def _events(self, follow: bool, stdout_offset: Optional[int],
                      stderr_offset: Optional[int], track: bool) -> AsyncIterator[OutputEvent]:
        saved = (self.stdout_offset, self.stderr_offset)
        params = self._output_params(follow, stdout_offset, stderr_offset)
        timeout = httpx.Timeout(None, connect=min(self._sb._client.timeout, 30.0))
        path = self._path("/output")
        try:
            async with self._sb._client._http.stream("GET", path, params=params,
                                                     timeout=timeout) as resp:
                if not resp.is_success:
                    await resp.aread()
                    _base.check(resp)
                async for line in resp.aiter_lines():
                    if line.strip():
                        yield self._parse(line)
        except httpx.HTTPError as e:
            raise TransportError(f"GET {path}: {e!r}") from e
        finally:
            if not track:
                self.stdout_offset, self.stderr_offset = saved

    async def signal(self, sig: Signal) -> None:
        """As :meth:`Process.signal`."""
        await self._sb._client._request("POST", self._path("/signal"), json=signal_body(sig))

    async def kill(self) -> None:
        """As :meth:`Process.kill`."""
        try:
            await self.signal("SIGKILL")
        except Conflict:
            pass

    async def write_stdin(self, data: Data, eof: bool = False) -> None:
        """As :meth:`Process.write_stdin`."""
        params = {"eof": "true"} if eof else {}
        await self._sb._client._request("POST", self._path("/stdin"), params=params,
                                        content=to_bytes(data),
                                        headers={"Content-Type": "application/octet-stream"})

    async def resize(self, rows: int, cols: int) -> None:
        """As :meth:`Process.resize`."""
        await self._sb._client._request("POST", self._path("/resize"),
                                        json={"rows": int(rows), "cols": int(cols)})

    async def close_stdin(self) -> None:
        """As :meth:`Process.close_stdin`."""
        await self.write_stdin(b"", eof=True)

    async def delete(self) -> None:
        """As :meth:`Process.delete`."""
        await self._sb._client._request("DELETE", self._path())


def processes_of(body: Any) -> List[Mapping[str, Any]]:
    """The ``processes`` list of ``GET …/processes``."""
    try:
        return list(body["processes"])
    except (KeyError, TypeError) as e:
        raise ProtocolError(f"bad process list {body!r:.300}") from e


__all__ = ["Process", "AsyncProcess", "OutputSkipped", "OutputEvent", "Signal"]
