"""Exceptions raised by the Sandlot SDK.

Every error the server answers has the body ``{"error": {"code": "...", "message": "..."}}``
(DESIGN.md, "HTTP API v1") and becomes the subclass of :class:`SandlotError` named after its
stable ``code``. Switch on the class (or ``.code``), never on ``.message``.

Failures that never produced an API answer (connection refused, reset, client-side timeout)
are :class:`TransportError`; answers that are not the documented shape are
:class:`ProtocolError`.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Type


class SandlotError(Exception):
    """Base class of every SDK error.

    Attributes:
        code: stable wire code, e.g. ``"not_found"`` (``"transport"`` / ``"protocol"`` for
            the client-side classes).
        message: human-readable explanation; may change between versions.
        status: HTTP status of the answer, ``None`` when there was no answer.
        retry_after: seconds from a ``Retry-After`` header, when the server sent one.
    """

    code: str = "unknown"

    def __init__(
        self,
        message: str,
        *,
        code: Optional[str] = None,
        status: Optional[int] = None,
        retry_after: Optional[float] = None,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.status = status
        self.retry_after = retry_after

    def __str__(self) -> str:
        where = f" (HTTP {self.status})" if self.status is not None else ""
        return f"{self.code}{where}: {self.message}"


class InvalidArgument(SandlotError):
    """The request is malformed or a field is out of range (HTTP 400)."""

    code = "invalid_argument"


class NotFound(SandlotError):
    """The sandbox, file or image does not exist (HTTP 404)."""

    code = "not_found"


class Conflict(SandlotError):
    """The request conflicts with the current state, e.g. the sandbox is being deleted (409)."""

    code = "conflict"


class ResourceExhausted(SandlotError):
    """A quota or capacity limit was hit; retry after ``retry_after`` seconds (HTTP 429)."""

    code = "resource_exhausted"


class DeadlineExceeded(SandlotError):
    """The operation did not finish in time (HTTP 504)."""

    code = "deadline_exceeded"


class Unavailable(SandlotError):
    """The feature or backend is not available on this host; the message says why (503)."""

    code = "unavailable"


class PermissionDenied(SandlotError):
    """The caller may not do this (HTTP 403)."""

    code = "permission_denied"


class Unauthenticated(SandlotError):
    """No or bad credentials (HTTP 401)."""

    code = "unauthenticated"


class PayloadTooLarge(SandlotError):
    """The request body is larger than the server's limit (HTTP 413)."""

    code = "payload_too_large"


class InternalError(SandlotError):
    """A fault inside Sandlot; the server log carries the cause (HTTP 500)."""

    code = "internal"


class TransportError(SandlotError):
    """No answer from the server: connection refused or reset, or the client timeout expired."""

    code = "transport"


class ProtocolError(SandlotError):
    """The server answered, but not with the documented shape (bad JSON, unknown fields)."""

    code = "protocol"


#: Wire code → exception class.
ERROR_CLASSES: Dict[str, Type[SandlotError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        Conflict,
        ResourceExhausted,
        DeadlineExceeded,
        Unavailable,
        PermissionDenied,
        Unauthenticated,
        PayloadTooLarge,
        InternalError,
    )
}

#: HTTP status → exception class, used when the body carries no known code.
_STATUS_CLASSES: Dict[int, Type[SandlotError]] = {
    400: InvalidArgument,
    401: Unauthenticated,
    403: PermissionDenied,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: InvalidArgument,
    429: ResourceExhausted,
    503: Unavailable,
    504: DeadlineExceeded,
}


def error_from_response(status: int, body: bytes, headers: Any = None) -> SandlotError:
    """Build the exception for a non-2xx answer.

    Args:
        status: HTTP status code.
        body: raw response body; ``{"error": {"code", "message"}}`` when the server follows
            the API, anything else otherwise (then the class is chosen from ``status``).
        headers: response headers (mapping), read for ``Retry-After`` (seconds).
    """
    import json

    code: Optional[str] = None
    message = ""
    try:
        err = json.loads(body)["error"]
        code = str(err["code"])
        message = str(err.get("message", ""))
    except Exception:
        message = body[:500].decode("utf-8", "replace").strip() or f"HTTP {status}"
    retry_after: Optional[float] = None
    if headers is not None:
        raw = headers.get("retry-after")
        if raw is not None:
            try:
                retry_after = float(raw)
            except ValueError:
                retry_after = None
    cls = ERROR_CLASSES.get(code or "") or _STATUS_CLASSES.get(
        status, InternalError if status >= 500 else SandlotError
    )
    # An unknown wire code (newer server) gets the class of its HTTP status but keeps its
    # own `.code`, so callers can still see it.
    return cls(message, code=code if code and code not in ERROR_CLASSES else None,
               status=status, retry_after=retry_after)
