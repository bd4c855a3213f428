"""Python SDK of Sandlot, isolated sandboxes for AI agents (HTTP API v1).

Start::

    import sandlot
    client = sandlot.Client()                      # SANDLOT_URL or http://127.0.0.1:7070
    with client.create(memory_mib=256) as sb:      # backend="function", image="python"
        r = sb.exec("python3 -c 'print(6*7)'")
        assert r.exit_code == 0 and r.stdout == b"42\\n"
        sb.write_file("data.bin", b"\\x00\\x01")   # relative to /workspace
    res = client.run_code("print(1)", language="python")   # SandboxFusion /run_code
    assert res.status == "Success"

Trajectory log (preemption-safe agent loops)::

    sb = client.create(trajectory="job-42/ep-7")   # or the live one already bound to it
    r = sb.exec("mkdir out")                        # step 0; after a restart of the
    r.replayed                                      # trainer: True, nothing ran again
    client.trajectory("job-42/ep-7").steps          # digests, exit codes, replay counts
    client.pause(labels={"job": "42"}); client.resume(labels={"job": "42"})

Checkpoints and forks::

    ck = sb.checkpoint()                            # the writable layer, on the node
    forks = [client.create(checkpoint=ck) for _ in range(3)]   # same files, own identity
    client.delete_checkpoint(ck)                    # forks live on

Background processes (handles that outlive the client)::

    p = sb.spawn("python3 server.py", stdin_open=True)   # returns at once
    for ev in p.output(follow=True): ...                  # chunks, then the ExecResult
    sb.process(p.id).signal("SIGTERM"); p.wait(timeout=10)

:class:`AsyncClient` / :class:`AsyncSandbox` mirror the same methods as coroutines.
Errors are :class:`SandlotError` subclasses named after the server's stable codes.
"""

from .aio import AsyncClient, AsyncSandbox
from .client import Client, Sandbox
from .errors import (Conflict, DeadlineExceeded, InternalError, InvalidArgument, NotFound,
                     PayloadTooLarge, PermissionDenied, ProtocolError, ResourceExhausted,
                     SandlotError, TransportError, Unauthenticated, Unavailable)
from .process import AsyncProcess, OutputSkipped, Process
from .models import (AffectedIds, BatchResult, Checkpoint, CommandRunResult, ExecEvent, ExecResult, FileEntry,
                     JupyterCell, RestoreMismatch, RestoreReport, RunCodeLanguage, RunCodeResult,
                     RunJupyterResult, StderrChunk, StdoutChunk,
                     TrajectoryInfo, TrajectoryStep)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient", "AsyncSandbox", "Client", "Sandbox",
    "SandlotError", "InvalidArgument", "NotFound", "Conflict", "ResourceExhausted",
    "DeadlineExceeded", "Unavailable", "PermissionDenied", "Unauthenticated",
    "PayloadTooLarge", "InternalError", "TransportError", "ProtocolError",
    "ExecResult", "ExecEvent", "StdoutChunk", "StderrChunk", "FileEntry",
    "RunCodeResult", "CommandRunResult", "RunJupyterResult", "JupyterCell", "RunCodeLanguage", "TrajectoryInfo", "TrajectoryStep",
    "RestoreReport", "RestoreMismatch", "AffectedIds", "BatchResult", "Checkpoint",
    "Process", "AsyncProcess", "OutputSkipped",
]
