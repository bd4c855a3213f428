"""Typed results of the Sandlot HTTP API v1 and the request builders shared by the sync and
async clients.

Field names follow the wire types in ``crates/sandlot-api/src/*.rs``; bytes that travel as
base64 on the wire (``stdout_b64``, ``stdin_b64``, ``files``) are plain ``bytes`` here.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Generic, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

from .errors import ERROR_CLASSES, ProtocolError, SandlotError

#: A command: an argv list (``PATH`` searched for ``argv[0]``) or a shell string (``sh -c``).
Command = Union[str, Sequence[str]]
#: Bytes, or text sent as UTF-8.
Data = Union[bytes, bytearray, memoryview, str]


def to_bytes(data: Data) -> bytes:
    """``data`` as bytes; ``str`` is encoded as UTF-8."""
    if isinstance(data, str):
        return data.encode("utf-8")
    return bytes(data)


def _b64(data: Data) -> str:
    return base64.b64encode(to_bytes(data)).decode("ascii")


def _exact(text: Optional[str], b64: Optional[str]) -> bytes:
    """Exact bytes of a stream: ``b64`` decoded when present, else ``text`` as UTF-8."""
    if b64 is not None:
        return base64.b64decode(b64)
    return (text or "").encode("utf-8")


@dataclass
class ExecResult:
    """Result of ``Sandbox.exec`` (and the last event of ``Sandbox.exec_stream``).

    Attributes:
        exit_code: the process's own code; 128+n when killed by signal n; 127 when the
            command was not found, 126 when it could not be executed.
        signal: signal number that killed the process, or ``None``.
        timed_out: the timeout expired and the whole process tree was killed.
        oom_killed: the kernel's OOM killer killed a process of this exec.
        duration_ms: wall-clock duration, milliseconds.
        stdout: exact stdout bytes kept (head + tail when ``truncated``). Empty in the
            result of a streamed exec (the bytes came as chunks).
        stderr: exact stderr bytes kept, likewise.
        stdout_bytes: total bytes the process wrote to stdout (before the cap).
        stderr_bytes: total bytes written to stderr.
        truncated: some output was dropped by the head+tail cap.
        replayed: the result came from the trajectory log without executing.
        violations: denied dangerous syscalls the command attempted, oldest first, each a
            dict ``{"layer": "seccomp", "syscall": str, "nr": int, "pid": int,
            "time_unix_ms": int}`` (the call failed with EPERM); empty when none. On gVisor
            (runsc) they come from its sentry's log, ``pid`` in gVisor's root pid namespace.
            Under a network policy, DNS queries the node refused during the exec too:
            ``{"layer": "dns", "name": str, "qtype": str, "time_unix_ms": int, ...}``, and
            packets its rules dropped (at most 10/s): ``{"layer": "network", "protocol":
            str, "dst": "ip:port", "time_unix_ms": int, ...}``.
    """

    exit_code: int
    signal: Optional[int] = None
    timed_out: bool = False
    oom_killed: bool = False
    duration_ms: float = 0.0
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    truncated: bool = False
    replayed: bool = False
    violations: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        """Stdout decoded as UTF-8 (invalid bytes replaced by U+FFFD)."""
        return self.stdout.decode("utf-8", "replace")

    @property
    def stdout_text(self) -> str:
        """Same as :attr:`text`."""
        return self.text

    @property
    def stderr_text(self) -> str:
        """Stderr decoded as UTF-8 (invalid bytes replaced by U+FFFD)."""
        return self.stderr.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        """True when the command exited 0 without timeout."""
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ExecResult":
        """Parse the wire ``ExecResult`` (``crates/sandlot-api/src/exec.rs``).

        Raises:
            ProtocolError: a required field is missing or has the wrong type.
        """
        try:
            return cls(
                exit_code=int(d["exit_code"]),
                signal=None if d.get("signal") is None else int(d["signal"]),
                timed_out=bool(d.get("timed_out", False)),
                oom_killed=bool(d.get("oom_killed", False)),
                duration_ms=float(d.get("duration_ms", 0.0)),
                stdout=_exact(d.get("stdout"), d.get("stdout_b64")),
                stderr=_exact(d.get("stderr"), d.get("stderr_b64")),
                stdout_bytes=int(d.get("stdout_bytes", 0)),
                stderr_bytes=int(d.get("stderr_bytes", 0)),
                truncated=bool(d.get("truncated", False)),
                replayed=bool(d.get("replayed", False)),
                violations=[dict(v) for v in d.get("violations") or []],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"bad ExecResult {dict(d)!r:.300}: {e}") from e


@dataclass
class StdoutChunk:
    """A chunk of stdout from ``Sandbox.exec_stream``; ``data`` holds the exact bytes."""

    data: bytes


@dataclass
class StderrChunk:
    """A chunk of stderr from ``Sandbox.exec_stream``; ``data`` holds the exact bytes."""

    data: bytes


#: One item of ``exec_stream``: chunks, then exactly one :class:`ExecResult`.
ExecEvent = Union[StdoutChunk, StderrChunk, ExecResult]


def parse_exec_event(line: Union[str, bytes]) -> ExecEvent:
    """Parse one NDJSON line of ``POST /v1/sandboxes/{id}/exec?stream=true``.

    Returns a chunk or the final :class:`ExecResult`.

    Raises:
        SandlotError subclass: the line is an ``error`` event (infrastructure failure).
        ProtocolError: the line is not a known event.
    """
    try:
        ev = json.loads(line)
        kind = ev["type"]
    except (ValueError, KeyError, TypeError) as e:
        raise ProtocolError(f"bad exec stream line {line!r:.300}: {e}") from e
    if kind == "stdout":
        return StdoutChunk(_exact(ev.get("data"), ev.get("data_b64")))
    if kind == "stderr":
        return StderrChunk(_exact(ev.get("data"), ev.get("data_b64")))
    if kind == "exit":
        return ExecResult.from_json(ev["result"])
    if kind == "error":
        err = ev.get("error") or {}
        code = str(err.get("code", "internal"))
        cls = ERROR_CLASSES.get(code, SandlotError)
        raise cls(str(err.get("message", "")), code=code if cls is SandlotError else None)
    raise ProtocolError(f"unknown exec stream event type {kind!r}")


@dataclass
class FileEntry:
    """One entry of ``Sandbox.list_dir``.

    Attributes:
        name: file name (not the full path).
        type: ``"file"``, ``"dir"``, ``"symlink"`` (not followed) or ``"other"``.
        size: size in bytes.
        mode: permission bits, e.g. ``0o644``.
        mtime: modification time, seconds since the Unix epoch.
        link_target: for a symlink, the absolute path inside the sandbox of its final
            target; ``None`` otherwise and for a dangling link.
    """

    name: str
    type: str
    size: int
    mode: int
    mtime: int
    link_target: Optional[str] = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "FileEntry":
        """Parse the wire ``FileEntry``."""
        try:
            target = d.get("link_target")
            return cls(str(d["name"]), str(d["type"]), int(d["size"]), int(d["mode"]),
                       int(d["mtime"]), None if target is None else str(target))
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"bad FileEntry {dict(d)!r:.300}: {e}") from e


@dataclass
class CommandRunResult:
    """One step (compile or run) of ``run_code``, SandboxFusion's ``CommandRunResult``.

    Attributes:
        status: ``"Finished"`` (exited, any code), ``"Error"`` (could not run) or
            ``"TimeLimitExceeded"``.
        execution_time: wall-clock seconds, or ``None``.
        return_code: exit code (128+n for signal n), or ``None``.
        stdout: stdout text, or ``None``.
        stderr: stderr text, or ``None``.
    """

    status: str
    execution_time: Optional[float] = None
    return_code: Optional[int] = None
    stdout: Optional[str] = None
    stderr: Optional[str] = None

    @classmethod
    def from_json(cls, d: Optional[Mapping[str, Any]]) -> Optional["CommandRunResult"]:
        """Parse the wire object; ``None`` stays ``None``."""
        if d is None:
            return None
        return cls(
            status=str(d.get("status")),
            execution_time=d.get("execution_time"),
            return_code=d.get("return_code"),
            stdout=d.get("stdout"),
            stderr=d.get("stderr"),
        )


@dataclass
class RunCodeResult:
    """Answer of ``run_code`` (SandboxFusion's ``RunCodeResponse``).

    Attributes:
        status: ``"Success"``, ``"Failed"`` (the program's own failure: compile error,
            non-zero exit, time limit) or ``"SandboxError"`` (Sandlot failed; the program's
            verdict is unknown).
        message: explanation for ``Failed``/``SandboxError``; empty on success.
        compile_result: compile step, for compiled languages.
        run_result: run step; ``None`` when compilation failed.
        executor_pod_name: node that ran it.
        files: fetched files, path → exact bytes (base64-decoded).
    """

    status: str
    message: str = ""
    compile_result: Optional[CommandRunResult] = None
    run_result: Optional[CommandRunResult] = None
    executor_pod_name: Optional[str] = None
    files: Dict[str, bytes] = field(default_factory=dict)

    @property
    def success(self) -> bool:
        """True when ``status == "Success"``."""
        return self.status == "Success"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "RunCodeResult":
        """Parse the wire ``RunCodeResponse``."""
        try:
            return cls(
                status=str(d["status"]),
                message=str(d.get("message") or ""),
                compile_result=CommandRunResult.from_json(d.get("compile_result")),
                run_result=CommandRunResult.from_json(d.get("run_result")),
                executor_pod_name=d.get("executor_pod_name"),
                files={k: base64.b64decode(v) for k, v in (d.get("files") or {}).items()},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"bad RunCodeResponse {dict(d)!r:.300}: {e}") from e


@dataclass
class JupyterCell:
    """What one cell of ``run_jupyter`` produced (SandboxFusion's ``CellRunResult``).

    Attributes:
        stdout: text the cell wrote to stdout.
        stderr: text the cell wrote to stderr.
        display: one MIME bundle per display / execute result, e.g.
            ``{"text/plain": "...", "image/png": "<base64>", "text/html": "..."}``.
        error: errors raised, each ``{"ename", "evalue", "traceback": [str]}``; a cell over
            its time limit gets ``ename == "TimeoutError"``.
    """

    stdout: str = ""
    stderr: str = ""
    display: List[Dict[str, Any]] = field(default_factory=list)
    error: List[Dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "JupyterCell":
        """Parse the wire ``CellRunResult``."""
        return cls(stdout=str(d.get("stdout") or ""), stderr=str(d.get("stderr") or ""),
                   display=[dict(x) for x in d.get("display") or []],
                   error=[dict(x) for x in d.get("error") or []])


@dataclass
class RunJupyterResult:
    """Answer of ``run_jupyter`` (SandboxFusion's ``RunJupyterResponse``).

    Attributes:
        status: ``"Success"`` (every cell ran; a cell that raised still ran, see its
            ``error``), ``"Failed"`` (a cell or the whole run over its time limit) or
            ``"SandboxError"`` (Sandlot failed, e.g. the ``lang-python`` image is missing).
        message: explanation for ``Failed``/``SandboxError``; empty on success.
        driver: the process that ran the kernel (a ``CommandRunResult``), or ``None``.
        cells: one :class:`JupyterCell` per cell run, in order.
        executor_pod_name: node that ran it.
        files: fetched files, path → exact bytes (base64-decoded).
    """

    status: str
    message: str = ""
    driver: Optional[CommandRunResult] = None
    cells: List[JupyterCell] = field(default_factory=list)
    executor_pod_name: Optional[str] = None
    files: Dict[str, bytes] = field(default_factory=dict)

    @property
    def success(self) -> bool:
        """True when ``status == "Success"``."""
        return self.status == "Success"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "RunJupyterResult":
        """Parse the wire ``RunJupyterResponse``."""
        try:
            return cls(
                status=str(d["status"]),
                message=str(d.get("message") or ""),
                driver=CommandRunResult.from_json(d.get("driver")),
                cells=[JupyterCell.from_json(c) for c in d.get("cells") or []],
                executor_pod_name=d.get("executor_pod_name"),
                files={k: base64.b64decode(v) for k, v in (d.get("files") or {}).items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProtocolError(f"bad RunJupyterResponse {dict(d)!r:.300}: {e}") from e


@dataclass
class RunCodeLanguage:
    """One row of ``GET /v1/run_code/languages``: a language mode of ``run_code``.

    Attributes:
        language: mode name (``python``, ``go_test``, ``R``, ``D_ut``, ...).
        aliases: other accepted names.
        image: image a call runs on now.
        file: source file name in ``/workspace`` (``{class}``: the declared class).
        compile: compile argv (``{file}``/``{class}`` placeholders) or ``None``.
        run: run argv.
        env: environment over the image's.
        layout: ``"program"`` or ``"tests"`` (Success = every test passes).
        memory_mib: default memory limit in MiB.
        installed: whether the toolchain image is on the node (else a call answers
            ``SandboxError``).
    """

    language: str
    image: str
    file: str
    run: List[str]
    compile: Optional[List[str]] = None
    aliases: List[str] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict)
    layout: str = "program"
    memory_mib: int = 512
    installed: bool = False

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "RunCodeLanguage":
        """Parse one wire row."""
        try:
            return cls(language=str(d["language"]), image=str(d["image"]), file=str(d["file"]),
                       run=[str(a) for a in d["run"]],
                       compile=None if d.get("compile") is None else [str(a) for a in d["compile"]],
                       aliases=[str(a) for a in d.get("aliases") or []],
                       env={str(k): str(v) for k, v in (d.get("env") or {}).items()},
                       layout=str(d.get("layout") or "program"),
                       memory_mib=int(d.get("memory_mib") or 0),
                       installed=bool(d.get("installed")))
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"bad run_code language {dict(d)!r:.300}: {e}") from e


@dataclass
class RestoreMismatch:
    """A replayed exec of a ``restore="replay"`` whose exit code differs from the log.

    Attributes:
        step: step number in the trajectory (from 0).
        logged_exit_code: exit code recorded when the step first ran.
        exit_code: exit code of the re-execution.
    """

    step: int
    logged_exit_code: int
    exit_code: int


@dataclass
class RestoreReport:
    """What a ``create(trajectory=T, restore="replay")`` did (wire ``Sandbox.restore``).

    Attributes:
        replayed_steps: logged mutating steps (exec, write_file, remove_file) re-executed.
        mismatches: execs whose exit code differed from the log; reported, not fatal.
    """

    replayed_steps: int
    mismatches: List[RestoreMismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every replayed exec exited as logged."""
        return not self.mismatches

    @classmethod
    def from_json(cls, d: Optional[Mapping[str, Any]]) -> Optional["RestoreReport"]:
        """Parse the wire object; ``None`` stays ``None``.

        Raises:
            ProtocolError: a field is missing or has the wrong type.
        """
        if d is None:
            return None
        try:
            return cls(
                replayed_steps=int(d["replayed_steps"]),
                mismatches=[RestoreMismatch(int(m["step"]), int(m["logged_exit_code"]),
                                            int(m["exit_code"]))
                            for m in d.get("mismatches") or []],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"bad RestoreReport {d!r:.300}: {e}") from e


@dataclass
class TrajectoryStep:
    """One logged step of a trajectory (``GET /v1/trajectories/{id}``).

    Attributes:
        step: step number, from 0, contiguous.
        kind: ``exec``, ``write_file``, ``remove_file``, ``read_file`` or ``list_dir``.
        digest: hex SHA-256 of the canonical JSON of the request.
        exit_code: exit code for ``exec`` steps, else ``None``.
        created_at: RFC 3339 UTC time the step was logged.
        replay_count: how many times the step was answered from the log.
    """

    step: int
    kind: str
    digest: str
    exit_code: Optional[int]
    created_at: str
    replay_count: int

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TrajectoryStep":
        """Parse the wire object. Raises ProtocolError on a bad shape."""
        try:
            return cls(
                step=int(d["step"]), kind=str(d["kind"]), digest=str(d["digest"]),
                exit_code=None if d.get("exit_code") is None else int(d["exit_code"]),
                created_at=str(d.get("created_at", "")),
                replay_count=int(d.get("replay_count", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"bad trajectory step {d!r:.300}: {e}") from e


@dataclass
class TrajectoryInfo:
    """A trajectory log (``GET /v1/trajectories/{id}``).

    Attributes:
        id: trajectory id (1–200 chars of ``[A-Za-z0-9._:/-]``).
        sandbox_id: the live sandbox bound to it, or ``None`` when gone.
        next_step: the step number the next executed call must carry.
        steps: logged steps, in order.
        replayed_total: answers served from the log, summed over the steps.
        raw: the JSON object received, unchanged.
    """

    id: str
    sandbox_id: Optional[str]
    next_step: int
    steps: List[TrajectoryStep]
    replayed_total: int
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TrajectoryInfo":
        """Parse the wire object. Raises ProtocolError on a bad shape."""
        try:
            return cls(
                id=str(d["id"]), sandbox_id=d.get("sandbox_id"),
                next_step=int(d["next_step"]),
                steps=[TrajectoryStep.from_json(s) for s in d["steps"]],
                replayed_total=int(d.get("replayed_total", 0)), raw=dict(d),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"bad trajectory {d!r:.300}: {e}") from e


#: Values of ``create(restore=...)``: fail when the trajectory's sandbox is gone (default),
#: or rebuild it by re-executing the logged mutating steps.
RESTORE_MODES = ("fail", "replay")

#: Values of ``create(runtime=...)`` (OCI runtime of ``backend="container"``). The server is
#: the judge: it refuses a runtime with another backend, and answers ``unavailable`` with the
#: reason when the runtime is not installed or cannot run on its host (crun on cgroup v1).
RUNTIMES = ("runc", "crun", "runsc")

#: A network policy: ``"none"`` (loopback only, the default) or ``{"allow": [entry, ...]}``
#: where each entry is a CIDR (``10.1.2.0/24``), an IP address or a DNS name.
Network = Union[str, Mapping[str, Sequence[str]]]

# Fields of the wire ``Sandbox`` copied onto the SDK's Sandbox objects.
SANDBOX_FIELDS = (
    "id", "backend", "image", "state", "node", "created_at", "expires_at", "cpu",
    "memory_mib", "disk_mib", "pids_max", "ttl_s", "labels", "network", "trajectory",
    "runtime", "accel",
)


def _put(body: Dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        body[key] = value


@dataclass
class Checkpoint:
    """A disk checkpoint of a sandbox (``POST /v1/sandboxes/{id}/checkpoints``): its
    writable layer saved on the node, the seed of forks (``client.create(checkpoint=ck)``).

    Attributes:
        id: ``ck-`` + 20 hex digits (the wire's ``checkpoint_id``).
        sandbox_id: the sandbox it was taken from (it may be gone since).
        backend, image: of that sandbox; forks use the same.
        runtime: OCI runtime of a container sandbox, else ``None``.
        disk_mib: the parent's disk size, MiB (forks' default).
        size_bytes: bytes the checkpoint occupies on the node's disk.
        created_at: RFC 3339 UTC.
        raw: the JSON object received, unchanged.
    """

    id: str
    sandbox_id: str
    backend: str
    image: str
    runtime: Optional[str]
    disk_mib: int
    size_bytes: int
    created_at: str
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Checkpoint":
        """Parse the wire object. Raises ProtocolError on a bad shape."""
        try:
            return cls(
                id=str(d["checkpoint_id"]), sandbox_id=str(d["sandbox_id"]),
                backend=str(d["backend"]), image=str(d["image"]), runtime=d.get("runtime"),
                disk_mib=int(d["disk_mib"]), size_bytes=int(d["size_bytes"]),
                created_at=str(d["created_at"]), raw=dict(d),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"bad checkpoint {d!r:.300}: {e}") from e


def checkpoints_of(body: Any) -> List[Checkpoint]:
    """The ``checkpoints`` of a ``GET /v1/checkpoints`` answer. Raises ProtocolError."""
    try:
        return [Checkpoint.from_json(c) for c in body["checkpoints"]]
    except (KeyError, TypeError) as e:
        raise ProtocolError(f"bad checkpoint list {body!r:.300}") from e


def checkpoint_id(checkpoint: Union[str, Checkpoint]) -> str:
    """The id of a :class:`Checkpoint` or an id string. Raises TypeError otherwise."""
    if isinstance(checkpoint, Checkpoint):
        return checkpoint.id
    if isinstance(checkpoint, str):
        return checkpoint
    raise TypeError(f"checkpoint must be a Checkpoint or its id (str), got {checkpoint!r}")


def create_body(
    backend: Optional[str], image: Optional[str], cpu: Optional[float],
    memory_mib: Optional[int],
    disk_mib: Optional[int], pids_max: Optional[int], ttl_s: Optional[int],
    env: Optional[Mapping[str, str]], labels: Optional[Mapping[str, str]],
    trajectory: Optional[str] = None, restore: Optional[str] = None,
    runtime: Optional[str] = None, network: Optional[Network] = None,
    checkpoint: Optional[Union[str, Checkpoint]] = None,
) -> Dict[str, Any]:
    """JSON body of ``POST /v1/sandboxes``; unset fields are left to the server's defaults
    and left out of the body (so a server that predates a field still accepts the call).
    ``backend`` and ``image`` default to ``"function"`` and ``"python"``, or, with
    ``checkpoint``, to the checkpoint's (left out of the body).

    Raises:
        ValueError: ``restore`` is not one of :data:`RESTORE_MODES`.
        TypeError: ``runtime`` is not a str, or ``network`` is neither a str nor a mapping
            whose ``allow`` is a list of str.
    """
    if restore is not None and restore not in RESTORE_MODES:
        raise ValueError(f"restore must be one of {RESTORE_MODES}, got {restore!r}")
    body: Dict[str, Any] = {}
    if checkpoint is not None:
        body["checkpoint"] = checkpoint_id(checkpoint)
    else:
        backend = "function" if backend is None else backend
        image = "python" if image is None else image
    _put(body, "backend", backend)
    _put(body, "image", image)
    _put(body, "cpu", cpu)
    _put(body, "memory_mib", memory_mib)
    _put(body, "disk_mib", disk_mib)
    _put(body, "pids_max", pids_max)
    _put(body, "ttl_s", ttl_s)
    if env:
        body["env"] = dict(env)
    if labels:
        body["labels"] = dict(labels)
    _put(body, "trajectory", trajectory)
    _put(body, "restore", restore)
    if runtime is not None:
        if not isinstance(runtime, str):
            raise TypeError(f"runtime must be a str (one of {RUNTIMES}), got {runtime!r}")
        body["runtime"] = runtime
    if network is not None:
        body["network"] = network_body(network)
    return body


def network_body(network: Network) -> Any:
    """Wire form of a network policy: the string as given (``"none"``), or
    ``{"allow": [str, ...]}`` from a mapping. Values are checked by the server.

    Raises:
        TypeError: neither a str nor a mapping with an ``allow`` list of str.
    """
    if isinstance(network, str):
        return network
    if isinstance(network, Mapping):
        allow = network.get("allow")
        if (isinstance(allow, (str, bytes)) or not isinstance(allow, Sequence)
                or not all(isinstance(a, str) for a in allow)):
            raise TypeError(f"network['allow'] must be a list of str, got {allow!r}")
        return {**dict(network), "allow": list(allow)}
    raise TypeError(f'network must be "none" or {{"allow": [...]}}, got {network!r}')


def exec_body(
    cmd: Command, cwd: Optional[str], env: Optional[Mapping[str, str]],
    stdin: Optional[Data], timeout_s: Optional[float], max_output_bytes: Optional[int],
    step: Optional[int] = None,
) -> Dict[str, Any]:
    """JSON body of ``POST /v1/sandboxes/{id}/exec`` (``step``: trajectory step number)."""
    if isinstance(cmd, (bytes, bytearray)):
        raise TypeError("cmd must be a str (shell string) or a sequence of str (argv)")
    body: Dict[str, Any] = {"cmd": cmd if isinstance(cmd, str) else [str(a) for a in cmd]}
    _put(body, "cwd", cwd)
    if env:
        body["env"] = dict(env)
    if stdin is not None:
        body["stdin_b64"] = _b64(stdin)
    _put(body, "timeout_s", timeout_s)
    _put(body, "max_output_bytes", max_output_bytes)
    _put(body, "step", step)
    return body


def run_code_body(
    code: str, language: str, compile_timeout: float, run_timeout: float,
    memory_limit_mb: int, stdin: Optional[str], files: Optional[Mapping[str, Data]],
    fetch_files: Optional[Sequence[str]],
) -> Dict[str, Any]:
    """JSON body of ``POST /run_code`` (SandboxFusion field names, e.g. ``memory_limit_MB``)."""
    body: Dict[str, Any] = {
        "code": code,
        "language": language,
        "compile_timeout": compile_timeout,
        "run_timeout": run_timeout,
        "memory_limit_MB": memory_limit_mb,
    }
    _put(body, "stdin", stdin)
    if files:
        body["files"] = {path: _b64(data) for path, data in files.items()}
    if fetch_files:
        body["fetch_files"] = list(fetch_files)
    return body


def run_jupyter_body(
    cells: Sequence[str], cell_timeout: float, total_timeout: float, memory_limit_mb: int,
    files: Optional[Mapping[str, Data]], fetch_files: Optional[Sequence[str]],
) -> Dict[str, Any]:
    """JSON body of ``POST /run_jupyter`` (SandboxFusion field names)."""
    if isinstance(cells, str):
        raise TypeError("cells must be a sequence of cell sources, not one string")
    body: Dict[str, Any] = {
        "cells": [str(c) for c in cells],
        "cell_timeout": cell_timeout,
        "total_timeout": total_timeout,
        "memory_limit_MB": memory_limit_mb,
        "kernel": "python3",
    }
    if files:
        body["files"] = {path: _b64(data) for path, data in files.items()}
    if fetch_files:
        body["fetch_files"] = list(fetch_files)
    return body


def selector_body(labels: Optional[Mapping[str, str]]) -> Dict[str, Any]:
    """JSON body of ``POST /v1/sandboxes:pause`` / ``:resume``: ``{"labels": {...}}``.

    Raises:
        ValueError: ``labels`` is empty (the server requires at least one pair, so a
            selector can never match every sandbox by accident).
    """
    if not labels:
        raise ValueError("pause/resume need at least one label pair")
    return {"labels": {str(k): str(v) for k, v in labels.items()}}


class AffectedIds(List[str]):
    """Ids a pause/resume changed (a plain list of str), plus ``failed``: id → the
    :class:`SandlotError` of each matching sandbox the node could not pause or resume
    (it keeps its previous state)."""

    failed: Dict[str, SandlotError]


def ids_of(body: Any) -> AffectedIds:
    """The answer of a pause/resume (wire ``PauseResult``). Raises ProtocolError."""
    try:
        ids = body["sandboxes"]
        if not isinstance(ids, list):
            raise TypeError("not a list")
        out = AffectedIds(str(i) for i in ids)
        out.failed = {}
        for f in body.get("failed") or []:
            err = f.get("error") or {}
            code = str(err.get("code", "internal"))
            cls = ERROR_CLASSES.get(code, SandlotError)
            out.failed[str(f["id"])] = cls(str(err.get("message", "")),
                                           code=code if cls is SandlotError else None)
        return out
    except (KeyError, TypeError, AttributeError) as e:
        raise ProtocolError(f"bad pause/resume answer {body!r:.300}: {e}") from e


def label_params(labels: Optional[Mapping[str, str]]) -> List[tuple]:
    """Query parameters of ``GET /v1/sandboxes?label=k=v`` (one per label, all must match)."""
    return [("label", f"{k}={v}") for k, v in (labels or {}).items()]


#: Sandboxes per ``GET /v1/sandboxes`` page when the SDK lists (the server allows 1..=10000).
LIST_PAGE = 1000


def list_page_params(labels: Optional[Mapping[str, str]], token: Optional[str]) -> List[tuple]:
    """Query parameters of one page of ``GET /v1/sandboxes``: the label filters, ``limit``
    :data:`LIST_PAGE` and the previous page's ``next_page_token`` (none for the first)."""
    params = label_params(labels) + [("limit", str(LIST_PAGE))]
    if token:
        params.append(("page_token", token))
    return params


def list_page_of(body: object) -> "tuple[list, Optional[str]]":
    """(sandbox dicts, next_page_token or None) of a ``GET /v1/sandboxes`` answer.

    Raises:
        ProtocolError: the body is not a sandbox list.
    """
    try:
        items = body["sandboxes"]  # type: ignore[index]
        token = body.get("next_page_token")  # type: ignore[union-attr]
        if not isinstance(items, list) or not (token is None or isinstance(token, str)):
            raise TypeError("sandboxes not a list or next_page_token not a string")
    except (KeyError, TypeError, AttributeError) as e:
        raise ProtocolError(f"bad sandbox list {body!r:.300}") from e
    return items, token


#: Keyword arguments of ``create`` that a ``create_many`` item may carry.
_CREATE_FIELDS = ("backend", "image", "cpu", "memory_mib", "disk_mib", "pids_max", "ttl_s",
                  "env", "labels", "runtime", "network", "checkpoint")

#: Most sandboxes one ``create_many`` call may ask for (the server's limit).
MAX_BATCH = 1000

_SB = TypeVar("_SB")


@dataclass
class BatchResult(Generic[_SB]):
    """Answer of ``create_many`` (``POST /v1/sandboxes:batch``): one entry per requested
    sandbox, in request order — the sandbox handle, or the :class:`SandlotError` (with its
    stable ``code`` and HTTP ``status``) of an item that failed and left nothing behind,
    e.g. :class:`~sandlot.errors.ResourceExhausted` over the API key's quota or without
    node capacity, :class:`~sandlot.errors.InvalidArgument` for a bad item."""

    results: List[Union[_SB, SandlotError]]

    @property
    def sandboxes(self) -> List[_SB]:
        """The items that have a sandbox, in request order."""
        return [r for r in self.results if not isinstance(r, SandlotError)]

    @property
    def errors(self) -> List[Tuple[int, SandlotError]]:
        """``(index, error)`` of the failed items, in request order."""
        return [(i, r) for i, r in enumerate(self.results) if isinstance(r, SandlotError)]


def batch_body(n: Optional[int], items: Optional[Sequence[Mapping[str, Any]]],
               common: Mapping[str, Any]) -> Dict[str, Any]:
    """JSON body of ``POST /v1/sandboxes:batch``: ``n`` copies of the create request made of
    ``common`` (the keyword arguments of ``create``), or ``items``, one create request per
    entry (each a mapping of ``create``'s keyword arguments, over ``common``).

    Raises:
        ValueError: both or neither of ``n`` and ``items``, or a size outside
            1..=:data:`MAX_BATCH`.
        TypeError: as :func:`create_body`; an unknown keyword, ``trajectory`` or
            ``restore``.
    """
    if (n is None) == (items is None):
        raise ValueError("give exactly one of n or items")

    def one(kw: Mapping[str, Any]) -> Dict[str, Any]:
        if "trajectory" in kw or "restore" in kw:
            raise TypeError("trajectory/restore are not accepted in a batch")
        args: Dict[str, Any] = {k: None for k in _CREATE_FIELDS}
        for k, v in kw.items():
            if k not in args:
                raise TypeError(f"unknown create argument {k!r}")
            args[k] = v
        return create_body(**args)

    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BATCH:
            raise ValueError(f"n must be an int in 1..{MAX_BATCH}, got {n!r}")
        return {**one(common), "count": n}
    assert items is not None
    if not 1 <= len(items) <= MAX_BATCH:
        raise ValueError(f"items must hold 1..{MAX_BATCH} entries, got {len(items)}")
    return {"items": [one({**common, **dict(it)}) for it in items]}


def batch_result(body: Any, make: Any) -> "BatchResult[Any]":
    """A :class:`BatchResult` from the JSON answer; ``make(dict)`` builds a sandbox handle.

    Raises:
        ProtocolError: the answer does not have the documented shape.
    """
    from .errors import error_from_response
    try:
        out: List[Any] = []
        for item in body["results"]:
            if item.get("sandbox") is not None:
                out.append(make(item["sandbox"]))
            else:
                raw = json.dumps({"error": item["error"]}).encode()
                out.append(error_from_response(int(item["status"]), raw))
        return BatchResult(out)
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"bad batch answer {body!r:.300}") from e
