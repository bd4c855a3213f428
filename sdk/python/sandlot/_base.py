"""Pieces shared by the sync and async clients: URLs, timeouts, retries, sandbox fields."""

from __future__ import annotations

import os
import random
import threading
import uuid
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union
from urllib.parse import quote

import httpx

from .errors import (ProtocolError, ResourceExhausted, SandlotError, TransportError,
                     Unavailable, error_from_response)
from .models import SANDBOX_FIELDS, RestoreReport

#: Used when neither ``url=`` nor ``SANDLOT_URL`` is given (``sandlot up``'s default listen).
DEFAULT_URL = "http://127.0.0.1:7070"
#: Server-side default exec timeout (``ExecRequest.timeout_s``), seconds.
DEFAULT_EXEC_TIMEOUT_S = 60.0


def resolve_urls(url: Union[None, str, Sequence[str]]) -> List[str]:
    """The server URLs of a client, in order of preference, without trailing slashes.

    ``url`` is one URL, several separated by commas (``"http://a:7070,http://b:7070"``)
    or a sequence of URLs; ``None`` takes env ``SANDLOT_URL`` (same forms), else
    :data:`DEFAULT_URL`.

    Raises:
        ValueError: no URL is left after dropping empty entries.
    """
    raw = url if url else (os.environ.get("SANDLOT_URL") or DEFAULT_URL)
    parts = raw.split(",") if isinstance(raw, str) else list(raw)
    urls = [str(u).strip().rstrip("/") for u in parts if str(u).strip()]
    if not urls:
        raise ValueError(f"no server URL in {url!r}")
    return urls


class ServerList:
    """The servers a client may send to (cluster mode: stateless ``sandlot server``
    replicas, every one answering every route), and which one it uses now.

    A call whose connection fails moves the client to the next server (round robin);
    :meth:`fail_over` is compare-and-set on the server that failed, so concurrent calls
    failing on one server move the client one step, not several. Thread-safe.
    """

    def __init__(self, urls: List[str]) -> None:
        self.urls = urls
        self._i = 0
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        """The URL calls go to now."""
        return self.urls[self._i]

    def fail_over(self, failed: str) -> str:
        """Move past ``failed`` when it is still the current server; the new current URL."""
        with self._lock:
            if self.urls[self._i] == failed:
                self._i = (self._i + 1) % len(self.urls)
            return self.urls[self._i]


def auto_idempotency_key() -> str:
    """A fresh ``Idempotency-Key`` for a create the caller gave none: a create retried
    after a lost answer (or through another server) then returns the sandbox the first
    attempt made instead of making a second one."""
    return f"sdk-{uuid.uuid4().hex}"


# A create whose answer is a replay of a create that another server left half-done can see
# that create rolled back (the leader's sweep forgets its key, marks it `deleting`, removes
# it): the SDK then sends it again, at most this many times in all.
CREATE_ATTEMPTS = 3
ROLLED_BACK = ("deleting", "deleted", "lost")


def rolled_back(sandbox_id: str) -> Unavailable:
    """The error of a create rolled back on every one of its ``CREATE_ATTEMPTS``."""
    return Unavailable(f"the create of sandbox {sandbox_id} was rolled back "
                       f"{CREATE_ATTEMPTS} times (a server stopped during it); try again")


def resolve_headers(api_key: Optional[str],
                    headers: Optional[Mapping[str, str]]) -> Dict[str, str]:
    """Headers of every request: ``headers`` plus ``Authorization: Bearer <key>`` with
    ``api_key``, else env ``SANDLOT_API_KEY`` (none when both are unset or empty, the
    server's no-auth loopback mode). An ``Authorization`` in ``headers`` wins."""
    out = dict(headers or {})
    key = api_key or os.environ.get("SANDLOT_API_KEY")
    if key and not any(k.lower() == "authorization" for k in out):
        out["Authorization"] = f"Bearer {key}"
    return out


def checkpoint_path(checkpoint_id: str) -> str:
    """``/v1/checkpoints/{id}`` with the id percent-encoded."""
    return f"/v1/checkpoints/{quote(checkpoint_id, safe='')}"


def sandbox_path(sandbox_id: str, suffix: str = "") -> str:
    """``/v1/sandboxes/{id}{suffix}`` with the id percent-encoded."""
    return f"/v1/sandboxes/{quote(sandbox_id, safe='')}{suffix}"


def trajectory_path(trajectory: str) -> str:
    """``/v1/trajectories/{id}`` with the id percent-encoded (ids may contain ``/``)."""
    return f"/v1/trajectories/{quote(trajectory, safe='')}"


#: Response header set on a file call answered from the trajectory log.
REPLAYED_HEADER = "sandlot-replayed"


def replayed_header(resp: httpx.Response) -> bool:
    """True when ``resp`` carries ``Sandlot-Replayed: true``."""
    return resp.headers.get(REPLAYED_HEADER, "").strip().lower() == "true"


def step_params(path: str, step: Optional[int]) -> Dict[str, Any]:
    """Query parameters of a file call: ``path`` and, when logged, ``step``."""
    params: Dict[str, Any] = {"path": path}
    if step is not None:
        params["step"] = step
    return params


class StepCounter:
    """Numbers the mutating calls of a sandbox bound to a trajectory (from 0).

    ``take`` reserves the number of a call and advances the counter at once; ``failed``
    gives the number back when the call raised, so a retry of the same call carries the
    same step (answered from the log if the server had logged it, else executed). A
    trajectory is a sequence: auto-numbered calls on one sandbox should not overlap; the
    lock only keeps the counter itself consistent.
    """

    def __init__(self, bound: bool) -> None:
        self.bound = bound
        self.next = 0
        self._lock = threading.Lock()

    def take(self, step: Optional[int], auto: bool) -> Tuple[Optional[int], int]:
        """The step to send (``None`` = unlogged) and the counter value to restore on
        failure. An explicit ``step`` is sent as given (also on a sandbox without a
        trajectory, where the server answers 400) and moves the counter to ``step + 1``;
        without one, a bound sandbox's ``auto`` calls get the next number.

        Raises:
            ValueError: ``step`` is negative or not an int.
        """
        with self._lock:
            prev = self.next
            if step is None:
                if not (auto and self.bound):
                    return None, prev
                step = prev
            elif isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"step must be an int >= 0, got {step!r}")
            self.next = step + 1
            return step, prev

    def failed(self, step: Optional[int], prev: int) -> None:
        """Undo ``take`` for a call that raised, unless a later call moved the counter."""
        if step is None:
            return
        with self._lock:
            if self.next == step + 1:
                self.next = prev


def http_limits() -> httpx.Limits:
    """Connection pool sized for hundreds of concurrent calls from one trainer process."""
    return httpx.Limits(max_connections=1024, max_keepalive_connections=128)


def call_timeout(base: float, work_s: Optional[float]) -> httpx.Timeout:
    """Client timeout of a call whose server-side work may take ``work_s`` seconds.

    The read timeout is ``work_s + base`` so the server's own limit (which yields a
    result with ``timed_out``) always fires before the client gives up.
    """
    read = base + (work_s or 0.0)
    return httpx.Timeout(read, connect=min(base, 30.0))


def check(resp: httpx.Response) -> httpx.Response:
    """Return ``resp`` when it is 2xx, else raise the matching :class:`SandlotError`.

    The body must already be read (``resp.read()`` / ``await resp.aread()``).
    """
    if resp.is_success:
        return resp
    raise error_from_response(resp.status_code, resp.content, resp.headers)


def json_of(resp: httpx.Response) -> Any:
    """The JSON body of a 2xx answer.

    Raises:
        ProtocolError: the body is not JSON.
    """
    try:
        return resp.json()
    except ValueError as e:
        raise ProtocolError(f"expected JSON from {resp.request.method} {resp.request.url}, "
                            f"got {resp.content[:200]!r}", status=resp.status_code) from e


def retry_delay(attempt: int, err: Optional[SandlotError]) -> float:
    """Seconds to wait before retry number ``attempt`` (0-based): the server's
    ``Retry-After`` when given, else exponential backoff with jitter, at most 5 s."""
    if err is not None and err.retry_after is not None:
        return min(max(err.retry_after, 0.0), 30.0)
    return min(5.0, 0.1 * (2 ** attempt)) * (0.5 + random.random() / 2)


IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE"})


def is_idempotent(method: str, headers: Optional[Mapping[str, str]]) -> bool:
    """Whether a request may be sent twice: an idempotent method (GET, HEAD, PUT, DELETE;
    RFC 9110 §9.2.2) or one carrying an ``Idempotency-Key``."""
    return method.upper() in IDEMPOTENT_METHODS or any(
        k.lower() == "idempotency-key" for k in (headers or {}))


def is_retryable(err: BaseException, method: str = "POST",
                 headers: Optional[Mapping[str, str]] = None) -> bool:
    """True for failures where sending again is safe: HTTP 429, any answer with
    ``Retry-After`` (overload is answered before any work, e.g. a ``run_code`` that found
    no free slot: 504 + Retry-After), connection setup failures, and — for idempotent
    requests only (:func:`is_idempotent`) — a connection that broke before the answer
    came (``httpx.RemoteProtocolError``, e.g. the server refused an oversize body on a
    kept-alive connection, or ``httpx.ReadError``/``WriteError``, e.g. the server was
    killed mid-call)."""
    if isinstance(err, ResourceExhausted):
        return True
    if isinstance(err, SandlotError) and err.retry_after is not None:
        return True
    if isinstance(err, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return is_idempotent(method, headers)
    return isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout))


class Retry:
    """What follows a failed attempt of one call: give up (raise) or send again, at once
    to another server or after a pause.

    Connection failures move to the next server of ``servers`` without a pause until
    every server was tried once; then (and for 429/``Retry-After`` answers) the call
    waits :func:`retry_delay` and counts one of ``retries``.
    """

    def __init__(self, servers: ServerList, retries: int, method: str, path: str,
                 headers: Optional[Mapping[str, str]]) -> None:
        self.servers, self.retries = servers, retries
        self.method, self.path, self.headers = method, path, headers
        self.attempt = 0
        self.hops = 0

    def after(self, err: BaseException, url: str) -> float:
        """Seconds to wait before the next attempt (0: send at once) after ``err`` from
        the attempt sent to ``url``.

        Raises:
            SandlotError: ``err`` itself, when it is an answer not worth retrying or the
                retries are spent.
            TransportError: no answer came and sending again is not safe, or the retries
                are spent.
        """
        transport = isinstance(err, httpx.HTTPError)
        if is_retryable(err, self.method, self.headers):
            if transport and self.hops + 1 < len(self.servers.urls):
                self.servers.fail_over(url)
                self.hops += 1
                return 0.0
            if self.attempt < self.retries:
                if transport:
                    self.servers.fail_over(url)
                self.hops = 0
                self.attempt += 1
                return retry_delay(self.attempt - 1, None if transport else err)  # type: ignore[arg-type]
        if transport:
            raise TransportError(f"{self.method} {url}{self.path}: {err!r}") from err
        raise err


class SandboxFields:
    """Attributes of a sandbox as the API returns them (``crates/sandlot-api/src/sandbox.rs``).

    Attributes:
        id: ``sb-`` + 20 hex digits.
        backend: ``function``, ``container``, ``microvm`` or ``vm``.
        image: image name.
        state: ``creating``, ``running``, ``paused``, ``deleting``, ``deleted`` or ``lost``.
        node: node that runs it.
        created_at: RFC 3339 UTC string.
        expires_at: RFC 3339 UTC string, or ``None`` without TTL.
        cpu: cores; memory_mib, disk_mib: MiB; pids_max: processes; ttl_s: seconds.
        labels: dict of str → str.
        network: network policy: ``"none"`` or ``{"allow": [CIDR, IP or DNS name, ...]}``.
        runtime: OCI runtime of a ``container`` sandbox (``runc``, ``crun``, ``runsc``);
            ``None`` for other backends and from servers that do not report it.
        accel: accelerator of a ``microvm`` or ``vm`` sandbox: ``"kvm"``, or ``"tcg"``
            (QEMU's binary translator, slow); ``None`` for other backends.
        trajectory: trajectory id or ``None``.
        restore: :class:`~sandlot.models.RestoreReport` of a ``create(restore="replay")``
            that rebuilt the sandbox, else ``None``.
        reattached: the create answered HTTP 200 with an existing sandbox (a live sandbox
            already bound to the trajectory, or an ``Idempotency-Key`` replay) instead of
            201 with a new one.
        next_step: step number the next auto-numbered mutating call will carry (0 after
            create/attach: an agent loop replays from its start). Only meaningful when
            ``trajectory`` is set.
        last_replayed: whether the last logged call (exec, write_file, remove, or a read
            given ``step=``) was answered from the log instead of running.
        raw: the last JSON object received, unchanged.
    """

    id: str
    backend: str
    image: str
    state: str
    node: str
    created_at: str
    expires_at: Optional[str]
    cpu: float
    memory_mib: int
    disk_mib: int
    pids_max: int
    ttl_s: int
    labels: Dict[str, str]
    network: Any
    trajectory: Optional[str]
    runtime: Optional[str]
    accel: Optional[str]
    restore: Optional[RestoreReport] = None
    reattached: bool = False
    last_replayed: bool = False
    raw: Dict[str, Any]
    _steps: StepCounter

    def _update(self, d: Mapping[str, Any]) -> None:
        if not isinstance(d, Mapping) or "id" not in d:
            raise ProtocolError(f"expected a Sandbox object, got {d!r:.300}")
        for name in SANDBOX_FIELDS:
            setattr(self, name, d.get(name))
        if self.labels is None:
            self.labels = {}
        # `restore` is only on the create answer; a later refresh keeps the report.
        if d.get("restore") is not None:
            self.restore = RestoreReport.from_json(d["restore"])
        if not hasattr(self, "_steps"):
            self._steps = StepCounter(bool(self.trajectory))
        self.raw = dict(d)

    @property
    def next_step(self) -> int:
        """Step number of the next auto-numbered mutating call (see ``SandboxFields``)."""
        return self._steps.next

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(id={self.id!r}, backend={self.backend!r}, "
                f"image={self.image!r}, state={self.state!r})")
