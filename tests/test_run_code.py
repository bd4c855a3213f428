"""`POST /run_code` end to end (SandboxFusion-compatible verdicts)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import sandlot


@pytest.fixture(scope="module")
def rc(client, python_image):
    return client


def test_python_success(rc):
    r = rc.run_code("import sys\nprint('hi', sys.version_info[0])")
    assert r.status == "Success" and r.message == ""
    assert r.run_result.status == "Finished" and r.run_result.return_code == 0
    assert r.run_result.stdout == "hi 3\n"
    assert r.run_result.execution_time is not None and r.run_result.execution_time > 0
    assert r.compile_result is None


def test_python_wrong_output_assert_is_failed(rc):
    r = rc.run_code("def f():\n    return 1\nassert f() == 2, 'wrong'\n")
    assert r.status == "Failed"
    assert r.run_result.status == "Finished" and r.run_result.return_code == 1
    assert "AssertionError: wrong" in r.run_result.stderr


def test_python_runtime_error_is_failed(rc):
    r = rc.run_code("print('before')\n1/0\n")
    assert r.status == "Failed"
    assert r.run_result.stdout == "before\n"
    assert "ZeroDivisionError" in r.run_result.stderr


def test_python_time_limit(rc):
    r = rc.run_code("print('start', flush=True)\nwhile True: pass\n", run_timeout=1)
    assert r.status == "Failed"
    assert r.run_result.status == "TimeLimitExceeded"
    assert r.run_result.stdout == "start\n"
    assert r.run_result.execution_time is None or r.run_result.execution_time < 10


def test_python_memory_limit(rc):
    r = rc.run_code("b = b'x' * (600 << 20)\nprint(len(b))\n", memory_limit_mb=64)
    assert r.status == "Failed", r
    assert r.run_result.return_code != 0 and "629145600" not in (r.run_result.stdout or "")


def test_stdin_files_and_fetch_files(rc):
    code = ("import sys\nx = sys.stdin.read()\nd = open('data/in.bin','rb').read()\n"
            "open('out.txt','w').write(x.upper() + str(len(d)))\nprint('ok')\n")
    r = rc.run_code(code, stdin="abc", files={"data/in.bin": b"\x00\xff\x01"},
                    fetch_files=["out.txt"])
    assert r.status == "Success", r
    assert r.files == {"out.txt": b"ABC3"}


def test_bash(rc):
    r = rc.run_code("read x\necho $((x * 2))\n", language="bash", stdin="21\n")
    assert r.status == "Success" and r.run_result.stdout == "42\n"
    r = rc.run_code("exit 7", language="bash")
    assert r.status == "Failed" and r.run_result.return_code == 7


CPP_OK = r"""
#include <iostream>
#include <vector>
int main() { long s = 0; int n; std::cin >> n; std::vector<int> v(n);
  for (int i = 0; i < n; i++) s += i; std::cout << s << std::endl; return 0; }
"""


def test_cpp_success(rc):
    r = rc.run_code(CPP_OK, language="cpp", stdin="1000\n", compile_timeout=60)
    assert r.status == "Success", r
    assert r.compile_result.status == "Finished" and r.compile_result.return_code == 0
    assert r.run_result.stdout == "499500\n"


def test_cpp_compile_error(rc):
    r = rc.run_code("int main() { return undefined_name; }", language="cpp",
                    compile_timeout=60)
    assert r.status == "Failed"
    assert r.compile_result.status == "Finished" and r.compile_result.return_code != 0
    assert "undefined_name" in r.compile_result.stderr
    assert r.run_result is None


def test_cpp_runtime_error_segfault(rc):
    r = rc.run_code("int main() { volatile int *p = 0; return *p; }", language="cpp",
                    compile_timeout=60)
    assert r.status == "Failed"
    assert r.run_result.return_code == 128 + 11


def test_unknown_language_is_invalid_argument(rc):
    with pytest.raises(sandlot.InvalidArgument) as e:
        rc.run_code("x", language="cobol")
    assert e.value.status == 400 and "cobol" in e.value.message


def test_64_concurrent_calls(rc):
    def one(i: int):
        return i, rc.run_code(f"import sys\nprint({i} * {i})\nsys.exit({i} % 2)")

    with ThreadPoolExecutor(max_workers=64) as pool:
        results = list(pool.map(one, range(64)))
    for i, r in results:
        assert r.status != "SandboxError", (i, r)
        assert r.run_result.stdout == f"{i * i}\n", (i, r)
        assert r.status == ("Success" if i % 2 == 0 else "Failed"), (i, r)


def test_program_writes_outside_workspace(rc):
    """A program may write /mnt (SandboxFusion's programs write e.g. /mnt/out): the node
    makes /mnt, /opt, /srv, /media the sandbox root's in its own writable layer, and
    landlock allows them; before, this was `Permission denied`."""
    code = ("import os\nos.makedirs('/mnt/out', exist_ok=True)\n"
            "open('/mnt/out/result.txt', 'w').write(open('/opt/in.txt').read() + '!')\n")
    r = rc.run_code(code, files={"/opt/in.txt": b"given"}, fetch_files=["/mnt/out/result.txt"])
    assert r.status == "Success", r
    assert r.files == {"/mnt/out/result.txt": b"given!"}
    # The image's own directories stay read-only.
    r = rc.run_code("open('/usr/x', 'w')\n")
    assert r.status == "Failed" and "Permission denied" in r.run_result.stderr, r


def test_output_past_the_cap_is_named_in_the_message(rc):
    # 3 MiB to stdout: 1 MiB is kept (first and last 512 KiB) and `message` says so, while
    # the verdict stays the program's.
    r = rc.run_code("import sys\nsys.stdout.write('HEAD' + 'x' * (3 << 20) + 'TAIL')")
    assert r.status == "Success", r
    out = r.run_result.stdout
    assert len(out) == 1 << 20 and out.startswith("HEAD") and out.endswith("TAIL")
    assert f"run stdout truncated: {(3 << 20) + 8} bytes written" in r.message, r.message
    assert "first and last 512 KiB kept" in r.message
    small = rc.run_code("print('ok')")
    assert small.message == "", small.message
