"""Asyncio client of the Sandlot HTTP API v1; mirrors :mod:`sandlot.client` method for method
(keep the two in step)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import httpx

from . import _base
from .errors import NotFound, ProtocolError, SandlotError, TransportError
from .models import (Checkpoint, Command, checkpoint_id, checkpoints_of, Data, ExecEvent, ExecResult, FileEntry, Network,
                     RunCodeResult, TrajectoryInfo, BatchResult, batch_body, batch_result, create_body, exec_body, ids_of, list_page_of, list_page_params,
                     parse_exec_event, run_code_body, run_jupyter_body,
                     RunCodeLanguage, RunJupyterResult, selector_body, to_bytes)
from .process import DEFAULT_PTY_CMD, AsyncProcess, processes_of, spawn_body


class AsyncClient:
    """A connection pool to a Sandlot server (or several of one cluster), for asyncio; share one per event loop.

    Args:
        url: base URL, e.g. ``http://127.0.0.1:7070``; default env ``SANDLOT_URL``, else
            ``http://127.0.0.1:7070``. Several servers of one cluster (stateless ``sandlot
            server`` replicas) are a list or one comma-separated string: calls go to the
            first, and a call whose connection fails moves to the next
            (:class:`~sandlot._base.ServerList`; ``client.url`` is the one in use).
        timeout: seconds allowed for a plain call; calls that run work (exec, run_code)
            get their own work time on top of it.
        retries: how many times a call answered 429 ``resource_exhausted`` (or whose
            connection could not be set up on any server) is sent again, after
            ``Retry-After`` or a backoff. Such calls did nothing on the server, so
            retrying is safe; so is resending an idempotent call (GET, DELETE, and every
            create, which carries an ``Idempotency-Key``) whose connection broke.
        api_key: API key (``sk-…`` from ``sandlot key create``) sent as ``Authorization:
            Bearer``; default env ``SANDLOT_API_KEY``, else none (a server without keys,
            on loopback, needs none).
        headers: extra headers on every request.

    Errors: every method raises a :class:`~sandlot.errors.SandlotError` subclass named after
    the server's error code, :class:`~sandlot.errors.TransportError` when no answer came.
    """

    def __init__(self, url: Union[None, str, Sequence[str]] = None, timeout: float = 30.0, retries: int = 3,
                 headers: Optional[Mapping[str, str]] = None,
                 api_key: Optional[str] = None) -> None:
        self._servers = _base.ServerList(_base.resolve_urls(url))
        self.urls = self._servers.urls
        self.timeout = float(timeout)
        self.retries = int(retries)
        self._http = httpx.AsyncClient(base_url=self._servers.current,
                                       timeout=_base.call_timeout(self.timeout, 0),
                                       limits=_base.http_limits(),
                                       headers=_base.resolve_headers(api_key, headers))

    # -- plumbing ---------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The server URL calls go to now (the first of ``urls`` until one fails)."""
        return self._servers.current

    async def _request(self, method: str, path: str, *, work_s: Optional[float] = None,
                 **kw: Any) -> httpx.Response:
        retry = _base.Retry(self._servers, self.retries, method, path, kw.get("headers"))
        while True:
            url = self._servers.current
            try:
                resp = await self._http.request(method, url + path,
                                          timeout=_base.call_timeout(self.timeout, work_s), **kw)
                return _base.check(resp)
            except (SandlotError, httpx.HTTPError) as e:
                delay = retry.after(e, url)
            if self._servers.current != url:
                self._http.base_url = httpx.URL(self._servers.current)
            if delay:
                await asyncio.sleep(delay)

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # -- API ---------------------------------------------------------------------------
    async def ping(self) -> bool:
        """``GET /v1/ping``; True when the server answers ``pong``."""
        return (await self._request("GET", "/v1/ping")).text.strip() == "pong"

    async def create(self, backend: Optional[str] = None, image: Optional[str] = None,
                     cpu: Optional[float] = None, memory_mib: Optional[int] = None,
                     disk_mib: Optional[int] = None, pids_max: Optional[int] = None,
                     ttl_s: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
                     labels: Optional[Mapping[str, str]] = None,
                     idempotency_key: Optional[str] = None, trajectory: Optional[str] = None,
                     restore: Optional[str] = None, runtime: Optional[str] = None,
                     network: Optional[Network] = None,
                     checkpoint: Optional[Union[str, Checkpoint]] = None) -> "AsyncSandbox":
        """Create a sandbox (``POST /v1/sandboxes``) and return it once running.

        Unset limits take the server defaults (cpu 1 core, memory 512 MiB, pids 256,
        ttl 600 s; ``ttl_s=0`` means no TTL). The same ``idempotency_key`` returns the
        same sandbox instead of a second one. ``runtime`` (OCI runtime of
        ``backend="container"``) and ``network`` (``"none"`` or ``{"allow": [...]}``): as
        :meth:`sandlot.Client.create`; fields left at ``None`` are not sent.

        Trajectory log: as :meth:`sandlot.Client.create` (``trajectory=``, ``restore=``,
        ``reattached``, ``next_step``, ``restore`` report).

        Fork: ``checkpoint=ck`` (a :class:`~sandlot.models.Checkpoint` or its id) starts
        the sandbox's writable layer as a copy of the checkpoint's; ``backend`` and
        ``image`` then default to the checkpoint's (others raise InvalidArgument), and
        ``disk_mib`` too. The fork gets its own hostname (its id), machine-id and entropy.

        Raises:
            InvalidArgument: unknown backend or runtime, a runtime with a backend other
                than ``container``, a bad network entry, a value out of range, bad
                trajectory id.
            NotFound: unknown image.  Unavailable: backend or runtime not available on
                this host (the message says why); or the create was rolled back on each
                of 3 attempts (an Idempotency-Key replay of a create whose server
                stopped: the SDK sends it again after a rollback).
            ResourceExhausted: node capacity exhausted (after ``retries``).
            Conflict: T has logged steps, its sandbox is gone and ``restore`` is not
                ``"replay"``.
            NotFound: unknown ``checkpoint`` (or another API key's).
            ValueError: ``restore`` is neither ``"fail"`` nor ``"replay"``.
            TypeError: ``runtime`` or ``network`` of the wrong type.
        """
        body = create_body(backend, image, cpu, memory_mib, disk_mib, pids_max, ttl_s, env,
                           labels, trajectory, restore, runtime, network, checkpoint)
        # A trajectory create is itself idempotent (it reattaches); others get a key.
        auto = not idempotency_key and not trajectory
        key = _base.auto_idempotency_key() if auto else idempotency_key
        headers = {"Idempotency-Key": key} if key else None
        return await self._create(body, headers, restore == "replay", auto)

    async def create_many(self, n: Optional[int] = None, *, items: Optional[Sequence[Mapping[str, Any]]] = None,
                      idempotency_key: Optional[str] = None, **create_kw: Any) -> BatchResult["AsyncSandbox"]:
        """Create many sandboxes in one call (``POST /v1/sandboxes:batch``): ``n`` alike
        (the keyword arguments as in :meth:`create`), or one per entry of ``items`` (each a
        mapping of :meth:`create`'s keyword arguments, over the common ones). At most
        1000 per call. The server runs each item's create as a single create (placement,
        quota, rollback on failure), many at once, and answers per item.

        Partial success is normal: the result lists, in request order, a sandbox handle or
        the error of each item (:class:`~sandlot.errors.ResourceExhausted` over the API
        key's quota or without node capacity; a failed item left nothing behind). The
        call carries an ``Idempotency-Key`` (``idempotency_key`` or one of the SDK's), so
        a retry after a lost answer returns the sandboxes already made (item i's key is
        ``KEY#i``). ``trajectory`` is not accepted in a batch.

        Raises:
            InvalidArgument: the batch as a whole is bad (a bad request with ``n``).
            ValueError: both or neither of ``n`` and ``items``, or a size outside 1..1000.
        """
        body = batch_body(n, items, create_kw)
        key = idempotency_key or _base.auto_idempotency_key()
        resp = await self._request("POST", "/v1/sandboxes:batch", json=body,
                                   headers={"Idempotency-Key": key}, work_s=600)
        return batch_result(_base.json_of(resp), lambda d: AsyncSandbox(self, d))

    async def attach(self, trajectory: str) -> "AsyncSandbox":
        """The live sandbox bound to ``trajectory``; as :meth:`sandlot.Client.attach`.

        Raises:
            Conflict: T has logged steps but its sandbox is gone.
            InvalidArgument: bad trajectory id.
        """
        return await self._create({"trajectory": trajectory}, None, False, False)

    async def _create(self, body: Dict[str, Any], headers: Optional[Dict[str, str]],
                      replay: bool, auto_key: bool) -> "AsyncSandbox":
        for _ in range(_base.CREATE_ATTEMPTS):
            resp = await self._request("POST", "/v1/sandboxes", json=body, headers=headers,
                                       work_s=600 if replay else 60)
            sb = AsyncSandbox(self, _base.json_of(resp))
            # 200 answers a replay; of the SDK's own key, that is this call's retry.
            sb.reattached = resp.status_code == 200 and not auto_key
            # An Idempotency-Key replay of a create still in flight answers `creating`.
            deadline = time.monotonic() + 60
            try:
                while sb.state == "creating" and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    await sb.refresh()
            except NotFound:
                continue  # rolled back and removed meanwhile: its key is free again
            if sb.state not in _base.ROLLED_BACK:
                return sb
        raise _base.rolled_back(sb.id)

    async def get(self, sandbox_id: str) -> "AsyncSandbox":
        """``GET /v1/sandboxes/{id}``. Raises NotFound for an unknown id."""
        resp = await self._request("GET", _base.sandbox_path(sandbox_id))
        return AsyncSandbox(self, _base.json_of(resp))

    async def list(self, labels: Optional[Mapping[str, str]] = None) -> List["AsyncSandbox"]:
        """Sandboxes whose labels include every ``labels`` pair, oldest first (this API
        key's; an admin key: all). Read in pages of :data:`~sandlot.models.LIST_PAGE`
        (``GET /v1/sandboxes?limit=…&page_token=…``), so the server never builds one
        answer of the whole registry."""
        out: List["AsyncSandbox"] = []
        token: Optional[str] = None
        while True:
            resp = await self._request("GET", "/v1/sandboxes",
                                       params=list_page_params(labels, token))
            items, token = list_page_of(_base.json_of(resp))
            out.extend(AsyncSandbox(self, d) for d in items)
            if not token:
                return out

    async def checkpoints(self) -> List[Checkpoint]:
        """``GET /v1/checkpoints``: this API key's checkpoints (an admin key: all), oldest
        first."""
        return checkpoints_of(_base.json_of(await self._request("GET", "/v1/checkpoints")))

    async def get_checkpoint(self, checkpoint: Union[str, Checkpoint]) -> Checkpoint:
        """``GET /v1/checkpoints/{id}``. Raises NotFound for an unknown id."""
        path = _base.checkpoint_path(checkpoint_id(checkpoint))
        return Checkpoint.from_json(_base.json_of(await self._request("GET", path)))

    async def delete_checkpoint(self, checkpoint: Union[str, Checkpoint]) -> None:
        """``DELETE /v1/checkpoints/{id}``; no error when already gone. Forks made from it
        live on (each has its own copy; a vm fork its own hard links to the
        checkpoint's qcow2 layers).

        Raises:
            Conflict: a create is copying from it right now (retry).
        """
        path = _base.checkpoint_path(checkpoint_id(checkpoint))
        await self._request("DELETE", path, work_s=30)

    async def delete(self, sandbox_id: str) -> None:
        """Delete a sandbox (``DELETE /v1/sandboxes/{id}``); no error when already gone."""
        await self._request("DELETE", _base.sandbox_path(sandbox_id), work_s=30)

    async def trajectory(self, trajectory: str) -> TrajectoryInfo:
        """``GET /v1/trajectories/{id}``. Raises NotFound for an unknown trajectory."""
        resp = await self._request("GET", _base.trajectory_path(trajectory))
        return TrajectoryInfo.from_json(_base.json_of(resp))

    async def delete_trajectory(self, trajectory: str) -> None:
        """``DELETE /v1/trajectories/{id}`` (the log only); no error when unknown."""
        await self._request("DELETE", _base.trajectory_path(trajectory))

    async def pause(self, labels: Mapping[str, str]) -> List[str]:
        """``POST /v1/sandboxes:pause``; as :meth:`sandlot.Client.pause`."""
        resp = await self._request("POST", "/v1/sandboxes:pause", json=selector_body(labels),
                                   work_s=60)
        return ids_of(_base.json_of(resp))

    async def resume(self, labels: Mapping[str, str]) -> List[str]:
        """``POST /v1/sandboxes:resume``; as :meth:`sandlot.Client.resume`."""
        resp = await self._request("POST", "/v1/sandboxes:resume", json=selector_body(labels),
                                   work_s=60)
        return ids_of(_base.json_of(resp))

    async def delete_labeled(self, labels: Mapping[str, str]) -> List[str]:
        """``POST /v1/sandboxes:delete``; as :meth:`sandlot.Client.delete_labeled`."""
        resp = await self._request("POST", "/v1/sandboxes:delete", json=selector_body(labels),
                                   work_s=60)
        return ids_of(_base.json_of(resp))

    async def run_code(self, code: str, language: str = "python", compile_timeout: float = 10,
                       run_timeout: float = 10, memory_limit_mb: int = -1,
                       stdin: Optional[str] = None, files: Optional[Mapping[str, Data]] = None,
                       fetch_files: Optional[Sequence[str]] = None) -> RunCodeResult:
        """One-shot ``POST /run_code`` (SandboxFusion-compatible) in a fresh sandbox.

        Args:
            code: program source.  language: any mode of :meth:`run_code_languages`
                (``python``, ``cpp``, ``java``, ``go``, ``rust``, ``nodejs``, ``pytest``,
                ``junit``, ... 25 in all).
            compile_timeout, run_timeout: seconds.  memory_limit_mb: MB, -1 = default.
            stdin: text fed to the program.  files: path → content written first
                (relative to ``/workspace``, or absolute).  fetch_files: paths returned in
                ``result.files`` as bytes.

        Returns the verdict; a program failure is ``status == "Failed"`` and a Sandlot
        failure ``status == "SandboxError"`` (neither raises; a language whose toolchain
        image is not installed is ``SandboxError``).

        Raises:
            InvalidArgument: unknown language or bad limits.  ResourceExhausted /
            DeadlineExceeded: server overloaded (after ``retries``).
        """
        body = run_code_body(code, language, compile_timeout, run_timeout, memory_limit_mb,
                             stdin, files, fetch_files)
        resp = await self._request("POST", "/run_code", json=body,
                             work_s=float(compile_timeout) + float(run_timeout) + 30)
        return RunCodeResult.from_json(_base.json_of(resp))

    async def run_jupyter(self, cells: Sequence[str], cell_timeout: float = 0,
                    total_timeout: float = 45, memory_limit_mb: int = -1,
                    files: Optional[Mapping[str, Data]] = None,
                    fetch_files: Optional[Sequence[str]] = None) -> RunJupyterResult:
        """One-shot ``POST /run_jupyter`` (SandboxFusion-compatible): ``cells`` run in order in
        one Python kernel in a fresh sandbox (image ``lang-python``).

        Args:
            cells: cell sources.  cell_timeout: seconds per cell, 0 = only the total.
            total_timeout: seconds for all cells.  memory_limit_mb: MB, -1 = default (1024).
            files: path → content written first (relative to ``/workspace``, or absolute).
            fetch_files: paths returned in ``result.files`` as bytes.

        Returns a :class:`RunJupyterResult`: per cell ``stdout``, ``stderr``, ``display``
        (MIME bundles: ``text/plain``, ``image/png`` base64, ``text/html``) and ``error``.

        Raises:
            InvalidArgument: bad limits or base64.  ResourceExhausted / DeadlineExceeded:
            server overloaded (after ``retries``).
        """
        body = run_jupyter_body(cells, cell_timeout, total_timeout, memory_limit_mb, files,
                                fetch_files)
        resp = await self._request("POST", "/run_jupyter", json=body,
                             work_s=float(total_timeout) + 60)
        return RunJupyterResult.from_json(_base.json_of(resp))

    async def run_code_languages(self) -> List[RunCodeLanguage]:
        """``GET /v1/run_code/languages``: every language mode of ``run_code``, in the
        server's table order, with its image and whether that image is installed."""
        resp = await self._request("GET", "/v1/run_code/languages")
        return [RunCodeLanguage.from_json(r) for r in _base.json_of(resp).get("languages", [])]


class AsyncSandbox(_base.SandboxFields):
    """A sandbox handle; attributes are those of the API's Sandbox (see SandboxFields);
    methods are coroutines.

    Used as an async context manager, the sandbox is deleted on exit. Paths are inside the
    sandbox; relative ones are relative to ``/workspace``. Trajectory steps are numbered
    as in :class:`sandlot.Sandbox`.
    """

    def __init__(self, client: AsyncClient, data: Mapping[str, Any]) -> None:
        self._client = client
        self._update(data)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.delete()

    def _path(self, suffix: str = "") -> str:
        return _base.sandbox_path(self.id, suffix)

    async def refresh(self) -> "AsyncSandbox":
        """Re-read the attributes from the server. Raises NotFound when gone."""
        self._update(_base.json_of(await self._client._request("GET", self._path())))
        return self

    async def keepalive(self, ttl_s: Optional[int] = None) -> "AsyncSandbox":
        """Push expiry to now + ``ttl_s`` seconds (default: the sandbox's own ``ttl_s``)."""
        body: Dict[str, Any] = {} if ttl_s is None else {"ttl_s": ttl_s}
        self._update(_base.json_of(await self._client._request("POST", self._path("/keepalive"),
                                                         json=body)))
        return self

    async def checkpoint(self) -> Checkpoint:
        """Save the sandbox's writable layer as a checkpoint
        (``POST /v1/sandboxes/{id}/checkpoints``); fork it with
        ``client.create(checkpoint=ck)``. The sandbox keeps running (its processes are
        frozen during the copy). Works on a paused sandbox too, except a microVM or VM.

        Raises:
            Conflict: the sandbox is not running (or a paused microVM or VM).
            InvalidArgument: the backend cannot checkpoint (every built-in one can).
        """
        resp = await self._client._request("POST", self._path("/checkpoints"), work_s=600)
        return Checkpoint.from_json(_base.json_of(resp))

    async def delete(self) -> None:
        """Delete the sandbox (kills everything in it); no error when already gone."""
        await self._client.delete(self.id)

    async def exec(self, cmd: Command, cwd: Optional[str] = None,
                   env: Optional[Mapping[str, str]] = None, stdin: Optional[Data] = None,
                   timeout_s: Optional[float] = None,
                   max_output_bytes: Optional[int] = None,
                   step: Optional[int] = None) -> ExecResult:
        """Run a command to completion and return its :class:`ExecResult`.

        Args:
            cmd: argv list, or a shell string run as ``/bin/sh -c``.
            cwd: working directory (default ``/workspace``).  env: extra variables.
            stdin: bytes (or text, UTF-8) fed to the command; without it stdin is /dev/null.
            timeout_s: wall-clock limit in seconds (server default 60, range (0, 86400]);
                on expiry the whole process tree is killed and ``timed_out`` is set.
            max_output_bytes: cap on kept bytes per stream (default 1 MiB, head+tail kept).

            step: trajectory step (default: ``next_step`` when bound to a trajectory).

        A command that fails (non-zero exit, signal, timeout, OOM) is a result, not an
        exception. ``result.replayed`` is True when it came from the trajectory log.
        Raises NotFound (sandbox gone), InvalidArgument (bad cwd or limits, step beyond
        the next one, step without trajectory), Conflict (the step is logged with another
        request digest, or the sandbox is paused).
        """
        s, prev = self._steps.take(step, auto=True)
        try:
            body = exec_body(cmd, cwd, env, stdin, timeout_s, max_output_bytes, s)
            resp = await self._client._request("POST", self._path("/exec"), json=body,
                                               work_s=timeout_s or _base.DEFAULT_EXEC_TIMEOUT_S)
            res = ExecResult.from_json(_base.json_of(resp))
        except BaseException:
            self._steps.failed(s, prev)
            raise
        if s is not None:
            self.last_replayed = res.replayed
        return res

    async def exec_stream(self, cmd: Command, cwd: Optional[str] = None,
                          env: Optional[Mapping[str, str]] = None, stdin: Optional[Data] = None,
                          timeout_s: Optional[float] = None,
                          max_output_bytes: Optional[int] = None,
                          step: Optional[int] = None) -> AsyncIterator[ExecEvent]:
        """Like :meth:`exec`, streamed: yields :class:`StdoutChunk`/:class:`StderrChunk`
        (``.data`` bytes) as the command writes, then exactly one :class:`ExecResult` whose
        ``stdout``/``stderr`` are empty (the bytes already came as chunks).

        Raises the error of an ``error`` event, or of a non-2xx answer, while iterating.
        Trajectory steps are numbered as in :meth:`exec` (the number is taken when
        iteration starts and given back if the stream fails before its exit record).
        """
        s, prev = self._steps.take(step, auto=True)
        ended = False
        try:
            async for ev in self._stream(cmd, cwd, env, stdin, timeout_s, max_output_bytes, s):
                if isinstance(ev, ExecResult):
                    ended = True
                    if s is not None:
                        self.last_replayed = ev.replayed
                yield ev
        finally:
            if not ended:
                self._steps.failed(s, prev)

    async def _stream(self, cmd: Command, cwd: Optional[str],
                      env: Optional[Mapping[str, str]], stdin: Optional[Data],
                      timeout_s: Optional[float], max_output_bytes: Optional[int],
                      step: Optional[int]) -> AsyncIterator[ExecEvent]:
        body = exec_body(cmd, cwd, env, stdin, timeout_s, max_output_bytes, step)
        timeout = _base.call_timeout(self._client.timeout,
                                     timeout_s or _base.DEFAULT_EXEC_TIMEOUT_S)
        try:
            async with self._client._http.stream("POST", self._path("/exec"),
                                           params={"stream": "true"}, json=body,
                                           timeout=timeout) as resp:
                if not resp.is_success:
                    await resp.aread()
                    _base.check(resp)
                ended = False
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    ev = parse_exec_event(line)
                    yield ev
                    if isinstance(ev, ExecResult):
                        ended = True
                if not ended:
                    raise ProtocolError("exec stream ended without an exit record")
        except httpx.HTTPError as e:
            raise TransportError(f"POST {self._path('/exec')}?stream=true: {e!r}") from e

    async def _logged(self, method: str, suffix: str, path: str, step: Optional[int],
                      auto: bool, work_s: float, **kw: Any) -> httpx.Response:
        """A file call carrying ``?step=`` when logged; records ``last_replayed``."""
        s, prev = self._steps.take(step, auto)
        try:
            resp = await self._client._request(method, self._path(suffix),
                                               params=_base.step_params(path, s),
                                               work_s=work_s, **kw)
        except BaseException:
            self._steps.failed(s, prev)
            raise
        if s is not None:
            self.last_replayed = _base.replayed_header(resp)
        return resp

    async def write_file(self, path: str, data: Data, step: Optional[int] = None) -> None:
        """Write ``data`` (bytes, or text as UTF-8) to ``path`` atomically, creating parent
        directories. A trajectory step like :meth:`exec`. Raises InvalidArgument (path
        escapes or is a directory), PayloadTooLarge, Conflict (diverging step, paused)."""
        await self._logged("PUT", "/files", path, step, True, 60, content=to_bytes(data),
                           headers={"Content-Type": "application/octet-stream"})

    async def read_file(self, path: str, step: Optional[int] = None) -> bytes:
        """The exact bytes of ``path``. Raises NotFound when missing. Logged as a
        trajectory step only when ``step`` is given."""
        return (await self._logged("GET", "/files", path, step, False, 60)).content

    async def list_dir(self, path: str = ".", step: Optional[int] = None) -> List[FileEntry]:
        """Entries of directory ``path``, sorted by name. Raises NotFound when missing.
        Logged as a trajectory step only when ``step`` is given."""
        body = _base.json_of(await self._logged("GET", "/files/list", path, step, False, 30))
        try:
            return [FileEntry.from_json(e) for e in body["entries"]]
        except (KeyError, TypeError) as e:
            raise ProtocolError(f"bad file list {body!r:.300}") from e

    async def stat(self, path: str) -> FileEntry:
        """Facts of ``path`` as a :class:`FileEntry` (``name`` is its last component, ``/``
        for the root; symlinks are followed inside the sandbox). Raises NotFound when
        missing, InvalidArgument for a refused path. Not a trajectory step."""
        resp = await self._client._request("GET", self._path("/files/stat"),
                                         params={"path": path}, work_s=30)
        return FileEntry.from_json(_base.json_of(resp))

    async def mkdir(self, path: str, parents: bool = False) -> None:
        """Create directory ``path`` (mode 0755, owned by the sandbox's root). With
        ``parents``, missing ancestors are created too and an existing directory is fine
        (``mkdir -p``). Raises NotFound (parent missing, without ``parents``), Conflict
        (exists, or a non-directory is in the way), InvalidArgument (refused path). Not a
        trajectory step."""
        await self._client._request("POST", self._path("/files/mkdir"),
                                   params={"path": path, "parents": "true" if parents else "false"},
                                   work_s=30)

    async def remove(self, path: str, step: Optional[int] = None) -> None:
        """Remove a file, or a directory recursively. A trajectory step like :meth:`exec`."""
        await self._logged("DELETE", "/files", path, step, True, 30)

    # -- background processes ----------------------------------------------------------
    async def spawn(self, cmd: Command, cwd: Optional[str] = None,
                    env: Optional[Mapping[str, str]] = None, stdin: Optional[Data] = None,
                    stdin_open: bool = False, timeout_s: Optional[float] = None,
                    max_output_bytes: Optional[int] = None,
                    pty: Optional[Tuple[int, int]] = None) -> AsyncProcess:
        """As :meth:`sandlot.Sandbox.spawn`."""
        body = spawn_body(cmd, cwd, env, stdin, stdin_open, timeout_s, max_output_bytes,
                          pty)
        resp = await self._client._request("POST", self._path("/processes"), json=body)
        return AsyncProcess(self, _base.json_of(resp))

    async def pty(self, cmd: Optional[Command] = None, rows: int = 24, cols: int = 80,
                  cwd: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
                  timeout_s: Optional[float] = None) -> AsyncProcess:
        """As :meth:`sandlot.Sandbox.pty`."""
        envs = {"TERM": "xterm-256color", **(env or {})}
        return await self.spawn(cmd if cmd is not None else list(DEFAULT_PTY_CMD), cwd=cwd,
                                env=envs, timeout_s=timeout_s, pty=(rows, cols))

    async def process(self, pid: str) -> AsyncProcess:
        """As :meth:`sandlot.Sandbox.process`."""
        resp = await self._client._request("GET", self._path(f"/processes/{pid}"))
        return AsyncProcess(self, _base.json_of(resp))

    async def processes(self) -> List[AsyncProcess]:
        """As :meth:`sandlot.Sandbox.processes`."""
        body = _base.json_of(await self._client._request("GET", self._path("/processes")))
        return [AsyncProcess(self, d) for d in processes_of(body)]
