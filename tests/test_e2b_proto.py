"""envd's binary protobuf codec (`application/proto`, `application/connect+proto`) against
`sandlot up` (docs/e2b.md, crates/sandlot-server/src/e2b/proto.rs).

The client is the Connect client the `e2b` SDK ships (`e2b.envd.*_connect`, on the
`connectrpc` package) with its default codec, binary protobuf, and the SDK's own generated
messages: a real, independent encoder and decoder of envd's proto files. Backend-independent
(the server transcodes; the handlers are the JSON codec's), so it runs on `function` only.
"""

from __future__ import annotations

import httpx
import pytest

e2b = pytest.importorskip("e2b", reason="the e2b SDK is not installed (scripts/setup.sh)")
from e2b import Sandbox  # noqa: E402

connectrpc = pytest.importorskip("connectrpc")
from connectrpc.errors import ConnectError  # noqa: E402
from e2b.envd.filesystem import filesystem_connect, filesystem_pb  # noqa: E402
from e2b.envd.process import process_connect, process_pb  # noqa: E402
from protobuf import Oneof  # noqa: E402


@pytest.fixture
def box(e2b_env, python_image):
    sb = Sandbox.create(template="base", timeout=120)
    yield sb
    sb.kill()


def test_connect_proto_start_list_stat_listdir(box):
    url = box.envd_api_url
    h = {"E2b-Sandbox-Id": box.sandbox_id}
    # send_compression=None: Sandlot refuses compressed requests (docs/e2b.md).
    with process_connect.ProcessClientSync(url, send_compression=None) as proc:
        events = list(proc.start(
            process_pb.StartRequest(process=process_pb.ProcessConfig(
                cmd="/bin/sh", args=["-c", "echo out; echo err >&2; mkdir -p /tmp/pb/d; "
                                           "printf x > /tmp/pb/f; exit 3"],
                envs={"A": "1"}, cwd="/tmp")),
            headers=h, timeout_ms=30_000))
        evs = [(e.event.event.field, e.event.event.value) for e in events]
        assert evs[0][0] == "start" and evs[0][1].pid >= 1000, evs[0]
        out = b"".join(v.output.value for k, v in evs
                       if k == "data" and v.output.field == "stdout")
        err = b"".join(v.output.value for k, v in evs
                       if k == "data" and v.output.field == "stderr")
        assert out == b"out\n" and err == b"err\n"
        assert evs[-1][0] == "end"
        end = evs[-1][1]
        assert end.exit_code == 3 and end.exited and end.status == "exit status 3"

        # a background process shows in List, is killed by SendSignal
        bg = proc.start(process_pb.StartRequest(
            process=process_pb.ProcessConfig(cmd="/bin/sh", args=["-c", "sleep 60"]),
            tag="pb-sleeper"), headers=h, timeout_ms=60_000)
        bg = iter(bg)
        first = next(bg).event.event
        assert first.field == "start"
        listed = proc.list(process_pb.ListRequest(), headers=h)
        tags = {p.tag: p.pid for p in listed.processes}
        assert tags.get("pb-sleeper") == first.value.pid
        assert [p.config.cmd for p in listed.processes if p.tag == "pb-sleeper"] == ["/bin/sh"]
        proc.send_signal(process_pb.SendSignalRequest(
            process=process_pb.ProcessSelector(selector=Oneof("tag", "pb-sleeper")),
            signal=process_pb.Signal.SIGKILL), headers=h)
        rest = list(bg)
        last = rest[-1].event.event
        assert last.field == "end" and last.value.status == "signal: killed"

    with filesystem_connect.FilesystemClientSync(url, send_compression=None) as fs:
        st = fs.stat(filesystem_pb.StatRequest(path="/tmp/pb/f"), headers=h).entry
        assert st.name == "f" and st.size == 1 and st.type == filesystem_pb.FileType.FILE
        assert st.owner == "root" and st.modified_time.seconds > 1_700_000_000
        entries = fs.list_dir(filesystem_pb.ListDirRequest(path="/tmp/pb", depth=1),
                              headers=h).entries
        assert {(e.name, e.type) for e in entries} == {
            ("d", filesystem_pb.FileType.DIRECTORY),
            ("f", filesystem_pb.FileType.FILE)}
        with pytest.raises(ConnectError) as ei:
            fs.stat(filesystem_pb.StatRequest(path="/tmp/pb/none"), headers=h)
        assert ei.value.code.value == "not_found"


def test_malformed_protobuf_is_invalid_argument(box):
    h = {"E2b-Sandbox-Id": box.sandbox_id}
    with httpx.Client(base_url=box.envd_api_url, timeout=30) as c:
        def post(path, body, ct):
            return c.post(path, content=body, headers={**h, "Content-Type": ct})

        # StatRequest.path: 5 bytes announced, 2 sent
        r = post("/filesystem.Filesystem/Stat", b"\x0a\x05ab", "application/proto")
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text
        assert "protobuf" in r.json()["message"]
        # a bad varint inside a stream envelope: 200, end-of-stream with the error
        r = post("/process.Process/Start", b"\x00\x00\x00\x00\x02\x0a\xff",
                 "application/connect+proto")
        assert r.status_code == 200 and r.content[0] == 2 and b'"invalid_argument"' in r.content
        # the unary codec on a stream method
        r = post("/process.Process/Start", b"", "application/proto")
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
        # unknown fields are skipped: an empty ListRequest with field 15 set
        r = post("/process.Process/List", b"\x78\x01", "application/proto")
        assert r.status_code == 200 and r.headers["content-type"] == "application/proto"
