"""`run_code` semantics that SandboxFusion's own runner tests rely on.

Each case is a program from, or shaped like, bytedance/SandboxFusion's
`sandbox/tests/runners/test_*.py` that Sandlot answered differently before (those files run
in full with tests/external/sandboxfusion_runners.py; this file keeps the fixes in CI):

- `localhost` resolves in the sandbox (`/etc/hosts` written per call; images have none);
- C# as `dotnet new console` + `dotnet run`: implicit `using`s (`Console` without
  `using System;`), `Debug.Assert` compiled in and fatal ("Assertion failed" on stderr,
  exit 134), `Main`'s return value as the exit code, an unhandled exception fails;
- Go: testify and the other Go modules of SandboxFusion's `runtime/go/go.mod` that Debian
  ships, importable in `go_test` and `go`;
- Java: javatuples on the class path (`java`, `junit`);
- jest: TypeScript test files (babel with preset-typescript, as SandboxFusion's
  `babel.config.js`);
- Lua: LuaUnit; Perl: Test::Deep and Data::Compare.

A case whose toolchain image is not installed skips with the reason.
"""

from __future__ import annotations

import base64

import httpx
import pytest

TIMEOUTS = {"compile_timeout": 120, "run_timeout": 60}  # cold compiles on a loaded host


@pytest.fixture(scope="module")
def installed(server):
    r = httpx.get(f"{server.url}/v1/run_code/languages", timeout=10)
    r.raise_for_status()
    return {row["language"]: row for row in r.json()["languages"]}


def run(server, installed, language: str, code: str, **kw) -> dict:
    row = installed[language]
    if not row["installed"]:
        pytest.skip(f"image {row['image']} is not installed (sandlot image build {row['image']})")
    body = {"language": language, "code": code, **TIMEOUTS, **kw}
    r = httpx.post(f"{server.url}/run_code", json=body, timeout=600)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] != "SandboxError", out
    return out


def ok(out: dict) -> None:
    assert out["status"] == "Success", out


def failed(out: dict) -> dict:
    assert out["status"] == "Failed", out
    assert out["run_result"] is not None and out["run_result"]["status"] == "Finished", out
    return out["run_result"]


# SandboxFusion's test_isolation.py SERVER_2: a server on a port, fetched at localhost.
LOCALHOST_SERVER = '''
import http.server, socketserver, threading, urllib.request
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"special string")
    def log_message(self, *a):
        pass
srv = socketserver.TCPServer(("", 0), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
print(urllib.request.urlopen(f"http://localhost:{srv.server_address[1]}", timeout=5).read().decode())
'''


def test_localhost_resolves(server, installed):
    out = run(server, installed, "python", LOCALHOST_SERVER)
    ok(out)
    assert out["run_result"]["stdout"].strip() == "special string"


def test_etc_hosts_names_loopback_and_files_may_replace_it(server, installed):
    code = "import socket; print(socket.gethostbyname('localhost'))"
    out = run(server, installed, "python", code)
    ok(out)
    assert out["run_result"]["stdout"] == "127.0.0.1\n"
    # The request's own files are written after the per-call setup, so they win.
    hosts = base64.b64encode(b"127.0.0.1 localhost myhost\n").decode()
    out = run(server, installed, "python", "import socket; print(socket.gethostbyname('myhost'))",
              files={"/etc/hosts": hosts})
    ok(out)
    assert out["run_result"]["stdout"] == "127.0.0.1\n"


CS_ASSERT = '''
using System;
using System.Diagnostics;

public class Program
{
    public static void Main(string[] args)
    {
        Console.WriteLine("before");
        Debug.Assert(1 == 2, "Assertion failed");
        Console.WriteLine("after");
    }
}
'''


def test_csharp_debug_assert_is_fatal(server, installed):
    rr = failed(run(server, installed, "csharp", CS_ASSERT))
    assert "Assertion failed" in rr["stderr"]
    assert rr["return_code"] == 134  # .NET aborts (SIGABRT) on a failed assert
    assert rr["stdout"] == "before\n"


def test_csharp_passing_assert_and_implicit_usings(server, installed):
    # No `using` at all: Console, List, LINQ and Debug (fully qualified) as in .NET 6+.
    code = '''
public class Program
{
    public static void Main(string[] args)
    {
        var xs = new List<int> { Convert.ToInt32(Console.ReadLine()), 2 };
        System.Diagnostics.Debug.Assert(xs.Count == 2);
        Console.WriteLine(xs.Sum());
    }
}
'''
    out = run(server, installed, "csharp", code, stdin="65535")
    ok(out)
    assert out["run_result"]["stdout"] == "65537\n"


def test_csharp_main_return_value_and_exception(server, installed):
    rr = failed(run(server, installed, "csharp", "class P { static int Main() { return 3; } }"))
    assert rr["return_code"] == 3
    code = 'class P { static void Main() { throw new InvalidOperationException("boom"); } }'
    rr = failed(run(server, installed, "csharp", code))
    assert "InvalidOperationException: boom" in rr["stderr"]


GO_TEST = '''
package main

import (
    "testing"
    "github.com/stretchr/testify/assert"
)

func Add(a, b int) int { return a + b }

func TestAdd(t *testing.T) {
    assert := assert.New(t)
    assert.Equal(%d, Add(1, 2))
}
'''


def test_go_test_with_testify(server, installed):
    ok(run(server, installed, "go_test", GO_TEST % 3))
    rr = failed(run(server, installed, "go_test", GO_TEST % 4))
    assert "Not equal" in rr["stdout"]


def test_go_program_imports_debian_gocode(server, installed):
    code = '''
package main

import (
    "fmt"
    "gopkg.in/yaml.v3"
)

func main() {
    var v map[string]int
    if err := yaml.Unmarshal([]byte("a: 1"), &v); err != nil { panic(err) }
    fmt.Println(v["a"])
}
'''
    out = run(server, installed, "go", code)
    ok(out)
    assert out["run_result"]["stdout"] == "1\n"


def test_java_javatuples(server, installed):
    code = '''
import org.javatuples.Pair;

public class Main {
    public static void main(String[] args) {
        Pair<String, Integer> p = Pair.with("apple", 1);
        System.out.println(p.getValue0() + " " + p.getValue1());
    }
}
'''
    out = run(server, installed, "java", code)
    ok(out)
    assert out["run_result"]["stdout"] == "apple 1\n"


def test_junit_javatuples(server, installed):
    code = '''
import org.junit.jupiter.api.Test;
import org.javatuples.Pair;
import static org.junit.jupiter.api.Assertions.*;

public class PairTest {
    @Test
    void first() { assertEquals("a", Pair.with("a", 1).getValue0()); }
}
'''
    ok(run(server, installed, "junit", code))


JEST_TS = '''
import { describe, expect, test } from '@jest/globals';

function add(a: number, b: number): number {
    return a + b;
}

describe('add', () => {
    test('adds', () => {
        expect(add(1, 2)).toBe(%d);
    });
});
'''


def test_jest_typescript(server, installed):
    ok(run(server, installed, "jest", JEST_TS % 3))
    rr = failed(run(server, installed, "jest", JEST_TS % 4))
    assert "Expected: 4" in rr["stderr"]


def test_lua_luaunit(server, installed):
    ok(run(server, installed, "lua", "lu = require('luaunit')\nlu.assertEquals(0, 0)\n"))
    rr = failed(run(server, installed, "lua", "lu = require('luaunit')\nlu.assertEquals(1, 2)\n"))
    assert "LuaUnit test FAILURE" in rr["stderr"]


def test_perl_test_deep_and_data_compare(server, installed):
    code = '''
use Test::Deep;
use Data::Compare;
exit 1 unless eq_deeply([1, {a => 2}], [1, {a => 2}]);
exit 2 unless Compare({x => [1]}, {x => [1]});
exit 3 if eq_deeply(1, 2);
print "ok!";
'''
    out = run(server, installed, "perl", code)
    ok(out)
    assert out["run_result"]["stdout"] == "ok!"
