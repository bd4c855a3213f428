"""Pieces shared by the sync and async clients: URLs, timeouts, retries, sandbox fields."""

from __future__ import annotations

import os
import random
from typing import Any, Dict, Mapping, Optional
from urllib.parse import quote

import httpx

from .errors import ProtocolError, ResourceExhausted, SandlotError, error_from_response
from .models import SANDBOX_FIELDS

#: Used when neither ``url=`` nor ``SANDLOT_URL`` is given (``sandlot up``'s default listen).
DEFAULT_URL = "http://127.0.0.1:7070"
#: Server-side default exec timeout (``ExecRequest.timeout_s``), seconds.
DEFAULT_EXEC_TIMEOUT_S = 60.0


def resolve_url(url: Optional[str]) -> str:
    """``url``, else env ``SANDLOT_URL``, else :data:`DEFAULT_URL`; no trailing slash."""
    return (url or os.environ.get("SANDLOT_URL") or DEFAULT_URL).rstrip("/")


def sandbox_path(sandbox_id: str, suffix: str = "") -> str:
    """``/v1/sandboxes/{id}{suffix}`` with the id percent-encoded."""
    return f"/v1/sandboxes/{quote(sandbox_id, safe='')}{suffix}"


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


def is_retryable(err: BaseException) -> bool:
    """True for failures where the server did nothing, so sending again is safe: HTTP 429,
    any answer with ``Retry-After`` (overload is answered before any work, e.g. a
    ``run_code`` that found no free slot: 504 + Retry-After) and connection setup failures."""
    if isinstance(err, ResourceExhausted):
        return True
    if isinstance(err, SandlotError) and err.retry_after is not None:
        return True
    return isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout))


class SandboxFields:
    """Attributes of a sandbox as the API returns them (``crates/sandlot-api/src/sandbox.rs``).

    Attributes:
        id: ``sb-`` + 20 hex digits.
        backend: ``function``, ``container``, ``microvm`` or ``vm``.
        image: image name.
        state: ``creating``, ``running``, ``deleting``, ``deleted`` or ``lost``.
        node: node that runs it.
        created_at: RFC 3339 UTC string.
        expires_at: RFC 3339 UTC string, or ``None`` without TTL.
        cpu: cores; memory_mib, disk_mib: MiB; pids_max: processes; ttl_s: seconds.
        labels: dict of str → str.
        network: network policy (``"none"``).
        trajectory: trajectory id or ``None``.
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
    raw: Dict[str, Any]

    def _update(self, d: Mapping[str, Any]) -> None:
        if not isinstance(d, Mapping) or "id" not in d:
            raise ProtocolError(f"expected a Sandbox object, got {d!r:.300}")
        for name in SANDBOX_FIELDS:
            setattr(self, name, d.get(name))
        if self.labels is None:
            self.labels = {}
        self.raw = dict(d)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(id={self.id!r}, backend={self.backend!r}, "
                f"image={self.image!r}, state={self.state!r})")
