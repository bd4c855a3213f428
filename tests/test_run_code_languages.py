"""Every `run_code` language through SandboxFusion's own client (`sandbox-fusion` on PyPI).

For each language mode of the server's table (`GET /v1/run_code/languages`), the cases a
code-RL reward depends on: print, stdin echo, runtime error (non-zero exit → Failed),
compile error (compiled languages: `compile_result` non-zero and no `run_result`), infinite
loop (→ TimeLimitExceeded), memory hog under `memory_limit_MB` (→ Failed), a file given in
`files` at an absolute path read by the program, a file the program wrote returned by
`fetch_files`; test-style modes (pytest, gtest, jest, go_test, junit, D_ut): a passing and a
failing test. A language whose toolchain image is not installed skips with the reason (CI
builds every image, so there nothing skips). Results go to
tests/artifacts/run-code-languages.md (language × case → pass / FAIL / skip).

Also: 128 concurrent mixed-language calls, each answered with its own correct verdict or a
fast 429/504.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Optional

import httpx
import pytest

sf = pytest.importorskip("sandbox_fusion",
                         reason="pip install sandbox-fusion (sdk/python [test] extra)")

ARTIFACT = Path(__file__).resolve().parent / "artifacts" / "run-code-languages.md"
IN_PATH = "/mnt/in/data.txt"  # absolute, outside /workspace
IN_TEXT = "from files"
OUT_TEXT = "written"


class Req(sf.RunCodeRequest):
    """The client's request plus `memory_limit_MB`, which SandboxFusion's server takes but
    client 0.3.7's model lacks (unknown fields would be dropped)."""

    memory_limit_MB: int = -1


# Programs per language. Keys: print (prints "hello"), echo (prints its first stdin line),
# rte (exits non-zero), cerr (does not compile; compiled languages only), loop (never
# ends), mem (allocates and touches > 1 GiB), read (prints the first line of IN_PATH),
# write (writes OUT_TEXT to out.txt in the working directory).
P: Dict[str, Dict[str, str]] = {
    "python": {
        "print": 'print("hello")\n',
        "echo": "print(input())\n",
        "rte": "1 / 0\n",
        "loop": "while True:\n    pass\n",
        "mem": "b = b'x' * (1536 << 20)\nprint(len(b))\n",
        "read": f"print(open('{IN_PATH}').read().strip())\n",
        "write": f"open('out.txt', 'w').write('{OUT_TEXT}')\n",
    },
    "bash": {
        "print": "echo hello\n",
        "echo": 'read l; echo "$l"\n',
        "rte": "exit 3\n",
        "loop": "while :; do :; done\n",
        "mem": "x=$(head -c 1500000000 /dev/zero | tr '\\0' x); echo ${#x}\n",
        "read": f"head -n1 {IN_PATH}\n",
        "write": f"printf {OUT_TEXT} > out.txt\n",
    },
    "cpp": {
        "print": '#include <cstdio>\nint main() { puts("hello"); }\n',
        "echo": "#include <iostream>\n#include <string>\nint main() { std::string s; "
                "std::getline(std::cin, s); std::cout << s << std::endl; }\n",
        "rte": "#include <stdexcept>\nint main() { throw std::runtime_error(\"boom\"); }\n",
        "cerr": "int main() { return undefined_name; }\n",
        "loop": "int main() { volatile unsigned x = 0; for (;;) x++; }\n",
        # volatile: -O2 may drop a malloc + memset whose result is unused.
        "mem": "#include <cstdlib>\n#include <cstdio>\nint main() { size_t n = 1536UL << 20; "
               "volatile char *p = (volatile char *)malloc(n); if (!p) return 2; "
               "for (size_t i = 0; i < n; i += 4096) p[i] = 1; printf(\"%d\\n\", p[n - 4096]); }\n",
        "read": f'#include <fstream>\n#include <iostream>\n#include <string>\nint main() {{ '
                f'std::ifstream f("{IN_PATH}"); std::string s; std::getline(f, s); '
                f'std::cout << s << std::endl; }}\n',
        "write": f'#include <fstream>\nint main() {{ std::ofstream("out.txt") << "{OUT_TEXT}"; }}\n',
    },
    "nodejs": {
        "print": 'console.log("hello");\n',
        "echo": "console.log(require('fs').readFileSync(0, 'utf8').split('\\n')[0]);\n",
        "rte": "null.x;\n",
        "loop": "for (;;) {}\n",
        "mem": "const b = Buffer.alloc(1536 * 1024 * 1024, 1); console.log(b.length);\n",
        "read": f"console.log(require('fs').readFileSync('{IN_PATH}', 'utf8').trim());\n",
        "write": f"require('fs').writeFileSync('out.txt', '{OUT_TEXT}');\n",
    },
    "typescript": {
        "print": 'const s: string = "hello";\nconsole.log(s);\n',
        "echo": "const fs = require('fs');\nconst l: string = fs.readFileSync(0, 'utf8').split('\\n')[0];\n"
                "console.log(l);\n",
        "rte": "const o: any = null;\nconsole.log(o.x);\n",
        "loop": "for (;;) {}\n",
        "mem": "const b: Buffer = Buffer.alloc(1536 * 1024 * 1024, 1);\nconsole.log(b.length);\n",
        "read": f"const fs = require('fs');\nconsole.log(fs.readFileSync('{IN_PATH}', 'utf8').trim());\n",
        "write": f"const fs = require('fs');\nfs.writeFileSync('out.txt', '{OUT_TEXT}');\n",
    },
    "go": {
        "print": 'package main\nimport "fmt"\nfunc main() { fmt.Println("hello") }\n',
        "echo": 'package main\nimport ("bufio"; "fmt"; "os")\nfunc main() { s := bufio.NewScanner(os.Stdin); '
                's.Scan(); fmt.Println(s.Text()) }\n',
        "rte": 'package main\nfunc main() { var m map[string]int; m["a"] = 1 }\n',
        "cerr": "package main\nfunc main() { x := }\n",
        "loop": "package main\nfunc main() { for {} }\n",
        "mem": 'package main\nimport "fmt"\nfunc main() { b := make([]byte, 1536<<20); '
               'for i := range b { b[i] = 1 }; fmt.Println(len(b)) }\n',
        "read": f'package main\nimport ("fmt"; "os"; "strings")\nfunc main() {{ b, err := os.ReadFile("{IN_PATH}"); '
                f'if err != nil {{ panic(err) }}; fmt.Println(strings.TrimSpace(string(b))) }}\n',
        "write": f'package main\nimport "os"\nfunc main() {{ os.WriteFile("out.txt", []byte("{OUT_TEXT}"), 0644) }}\n',
    },
    "java": {
        "print": 'public class Main { public static void main(String[] a) { System.out.println("hello"); } }\n',
        "echo": "import java.util.*;\npublic class Main { public static void main(String[] a) { "
                "System.out.println(new Scanner(System.in).nextLine()); } }\n",
        "rte": "public class Main { public static void main(String[] a) { Object o = null; o.hashCode(); } }\n",
        "cerr": "public class Main { public static void main(String[] a) { int x = \"a\"; } }\n",
        "loop": "public class Main { public static void main(String[] a) { while (true) {} } }\n",
        "mem": "public class Main { public static void main(String[] a) { byte[][] b = new byte[1536][]; "
               "for (int i = 0; i < b.length; i++) { b[i] = new byte[1 << 20]; b[i][0] = 1; } "
               "System.out.println(b.length); } }\n",
        "read": f"import java.nio.file.*;\npublic class Main {{ public static void main(String[] a) throws Exception {{ "
                f'System.out.println(new String(Files.readAllBytes(Paths.get("{IN_PATH}"))).trim()); }} }}\n',
        "write": f"import java.nio.file.*;\npublic class Main {{ public static void main(String[] a) throws Exception {{ "
                 f'Files.write(Paths.get("out.txt"), "{OUT_TEXT}".getBytes()); }} }}\n',
    },
    "rust": {
        "print": 'fn main() { println!("hello"); }\n',
        "echo": "fn main() { let mut s = String::new(); std::io::stdin().read_line(&mut s).unwrap(); "
                'println!("{}", s.trim_end()); }\n',
        "rte": 'fn main() { let v: Vec<i32> = Vec::new(); println!("{}", v[std::env::args().count() + 1]); }\n',
        "cerr": 'fn main() { let x: i32 = "a"; }\n',
        "loop": "fn main() { let mut x: u64 = 0; loop { x = x.wrapping_add(1); if x == 0 { println!(\"{}\", x); } } }\n",
        "mem": 'fn main() { let v = vec![1u8; 1536 << 20]; println!("{}", v[v.len() - 1]); }\n',
        "read": f'fn main() {{ println!("{{}}", std::fs::read_to_string("{IN_PATH}").unwrap().trim()); }}\n',
        "write": f'fn main() {{ std::fs::write("out.txt", "{OUT_TEXT}").unwrap(); }}\n',
    },
    "php": {
        "print": 'echo "hello\\n";\n',
        "echo": "<?php\necho trim(fgets(STDIN)), \"\\n\";\n",
        "rte": "<?php\nthrow new Exception('boom');\n",
        "loop": "<?php\nwhile (true) {}\n",
        "mem": "<?php\nini_set('memory_limit', '-1');\n$s = str_repeat('x', 1536 << 20);\necho strlen($s), \"\\n\";\n",
        "read": f"<?php\necho trim(file_get_contents('{IN_PATH}')), \"\\n\";\n",
        "write": f"<?php\nfile_put_contents('out.txt', '{OUT_TEXT}');\n",
    },
    "ruby": {
        "print": 'puts "hello"\n',
        "echo": "puts STDIN.gets\n",
        "rte": "raise 'boom'\n",
        "loop": "loop {}\n",
        "mem": 's = "x" * (1536 << 20)\nputs s.size\n',
        "read": f"puts File.read('{IN_PATH}').strip\n",
        "write": f"File.write('out.txt', '{OUT_TEXT}')\n",
    },
    "lua": {
        "print": 'print("hello")\n',
        "echo": 'print(io.read("l"))\n',
        "rte": 'error("boom")\n',
        "loop": "while true do end\n",
        "mem": "local t = {}\nfor i = 1, 400000000 do t[i] = i end\nprint(#t)\n",
        "read": f'print(io.open("{IN_PATH}"):read("l"))\n',
        "write": f'local f = io.open("out.txt", "w"); f:write("{OUT_TEXT}"); f:close()\n',
    },
    "perl": {
        "print": 'print "hello\\n";\n',
        "echo": "my $l = <STDIN>; print $l;\n",
        "rte": 'die "boom\\n";\n',
        "loop": "while (1) {}\n",
        "mem": 'my $s = "x" x (1536 << 20); print length($s), "\\n";\n',
        "read": f'open(my $f, "<", "{IN_PATH}") or die; my $l = <$f>; print $l;\n',
        "write": f'open(my $o, ">", "out.txt") or die; print $o "{OUT_TEXT}"; close $o;\n',
    },
    "R": {
        "print": 'cat("hello\\n")\n',
        "echo": 'l <- readLines(file("stdin"), n = 1)\ncat(l, "\\n", sep = "")\n',
        "rte": 'stop("boom")\n',
        "loop": "while (TRUE) {}\n",
        "mem": "x <- rep(1.5, 2e8)\ncat(length(x), '\\n')\n",
        "read": f'cat(readLines("{IN_PATH}", n = 1), "\\n", sep = "")\n',
        "write": f'cat("{OUT_TEXT}", file = "out.txt")\n',
    },
    "csharp": {
        "print": 'class P { static void Main() { System.Console.WriteLine("hello"); } }\n',
        "echo": "class P { static void Main() { System.Console.WriteLine(System.Console.ReadLine()); } }\n",
        "rte": "class P { static void Main() { object o = null; System.Console.WriteLine(o.ToString()); } }\n",
        "cerr": 'class P { static void Main() { int x = "a"; } }\n',
        "loop": "class P { static void Main() { while (true) {} } }\n",
        "mem": "class P { static void Main() { var b = new byte[1536][]; for (int i = 0; i < b.Length; i++) "
               "{ b[i] = new byte[1 << 20]; for (int j = 0; j < b[i].Length; j += 4096) b[i][j] = 1; } "
               "System.Console.WriteLine(b.Length); } }\n",
        "read": f'class P {{ static void Main() {{ System.Console.WriteLine(System.IO.File.ReadAllText("{IN_PATH}").Trim()); }} }}\n',
        "write": f'class P {{ static void Main() {{ System.IO.File.WriteAllText("out.txt", "{OUT_TEXT}"); }} }}\n',
    },
    "scala": {
        "print": 'object Main { def main(a: Array[String]): Unit = println("hello") }\n',
        "echo": "object Main { def main(a: Array[String]): Unit = println(scala.io.StdIn.readLine()) }\n",
        "rte": "object Main { def main(a: Array[String]): Unit = { val o: String = null; println(o.length) } }\n",
        "cerr": 'object Main { def main(a: Array[String]): Unit = { val x: Int = "a" } }\n',
        "loop": "object Main { def main(a: Array[String]): Unit = while (true) {} }\n",
        "mem": "object Main { def main(a: Array[String]): Unit = { val b = Array.fill(1536)(new Array[Byte](1 << 20)); "
               "println(b.length) } }\n",
        "read": f'object Main {{ def main(a: Array[String]): Unit = println(scala.io.Source.fromFile("{IN_PATH}").mkString.trim) }}\n',
        "write": f'object Main {{ def main(a: Array[String]): Unit = java.nio.file.Files.write('
                 f'java.nio.file.Paths.get("out.txt"), "{OUT_TEXT}".getBytes) }}\n',
    },
    "kotlin_script": {
        "print": 'println("hello")\n',
        "echo": "println(readLine())\n",
        "rte": 'throw RuntimeException("boom")\n',
        "loop": "while (true) {}\n",
        "mem": "val b = Array(1536) { ByteArray(1 shl 20) }\nprintln(b.size)\n",
        "read": f'println(java.io.File("{IN_PATH}").readText().trim())\n',
        "write": f'java.io.File("out.txt").writeText("{OUT_TEXT}")\n',
    },
    "racket": {
        "print": '#lang racket\n(displayln "hello")\n',
        "echo": "#lang racket\n(displayln (read-line))\n",
        "rte": '#lang racket\n(error "boom")\n',
        "loop": "#lang racket\n(let loop () (loop))\n",
        "mem": "#lang racket\n(define v (make-bytes (* 1536 1024 1024) 1))\n(displayln (bytes-length v))\n",
        "read": f'#lang racket\n(displayln (string-trim (file->string "{IN_PATH}")))\n',
        "write": f'#lang racket\n(with-output-to-file "out.txt" (lambda () (display "{OUT_TEXT}")))\n',
    },
    "verilog": {
        "print": 'module tb; initial begin $display("hello"); $finish; end endmodule\n',
        "echo": None,  # vvp has no stdin input worth testing
        "rte": "module tb; initial begin $fatal(1, \"boom\"); end endmodule\n",
        "cerr": "module tb; initial begin x = ; end endmodule\n",
        "loop": "module tb; reg c = 0; always #1 c = ~c; endmodule\n",
        "mem": None,  # a simulation cannot allocate at will
        "read": f'module tb; integer f, r; reg [8*64:1] s; initial begin f = $fopen("{IN_PATH}", "r"); '
                f'r = $fgets(s, f); $write("%0s", s); $finish; end endmodule\n',
        "write": f'module tb; integer f; initial begin f = $fopen("out.txt", "w"); $fwrite(f, "{OUT_TEXT}"); '
                 f'$fclose(f); $finish; end endmodule\n',
    },
    "sql": {
        "print": "SELECT 'hello';\n",
        "echo": None,  # sqlite3 reads the program, not stdin
        "rte": "SELECT * FROM no_such_table;\n",
        "loop": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c;\n",
        "mem": None,
        "read": f"SELECT trim(readfile('{IN_PATH}'), char(10));\n",
        "write": f"SELECT writefile('out.txt', '{OUT_TEXT}');\n",
    },
}

# Test-style modes: a passing and a failing test file.
T: Dict[str, Dict[str, str]] = {
    "pytest": {
        "pass": "def test_add():\n    assert 1 + 1 == 2\n",
        "fail": "def test_add():\n    assert 1 + 1 == 3\n",
    },
    "gtest": {
        "pass": "#include <gtest/gtest.h>\nTEST(A, Add) { EXPECT_EQ(1 + 1, 2); }\n",
        "fail": "#include <gtest/gtest.h>\nTEST(A, Add) { EXPECT_EQ(1 + 1, 3); }\n",
    },
    "jest": {
        "pass": "test('add', () => { expect(1 + 1).toBe(2); });\n",
        "fail": "test('add', () => { expect(1 + 1).toBe(3); });\n",
    },
    "go_test": {
        "pass": 'package main\nimport "testing"\nfunc TestAdd(t *testing.T) { if 1+1 != 2 { t.Fatal("no") } }\n',
        "fail": 'package main\nimport "testing"\nfunc TestAdd(t *testing.T) { if 1+1 != 3 { t.Fatal("no") } }\n',
    },
    "junit": {
        "pass": "import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.*;\n"
                "public class AddTest { @Test void add() { assertEquals(2, 1 + 1); } }\n",
        "fail": "import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.*;\n"
                "public class AddTest { @Test void add() { assertEquals(3, 1 + 1); } }\n",
    },
    "D_ut": {
        "pass": "unittest { assert(1 + 1 == 2); }\nvoid main() {}\n",
        "fail": "unittest { assert(1 + 1 == 3); }\nvoid main() {}\n",
    },
}

CASES = ["print", "echo", "rte", "cerr", "loop", "mem", "read", "write"]
RESULTS: Dict[str, Dict[str, str]] = {}


@pytest.fixture(scope="module")
def table(server) -> Dict[str, dict]:
    r = httpx.get(f"{server.url}/v1/run_code/languages", timeout=10)
    r.raise_for_status()
    return {row["language"]: row for row in r.json()["languages"]}


def call(url: str, language: str, code: str, **kw) -> "sf.RunCodeResponse":
    return sf.run_code(Req(code=code, language=language, **kw), endpoint=url, max_attempts=1,
                       client_timeout=300)


def check(url: str, lang: str, compiled: bool, case: str, code: str) -> None:
    """Runs one case and asserts its verdict (raises AssertionError on a wrong one)."""
    OK = sf.RunStatus.Success
    FAILED = sf.RunStatus.Failed
    ct = 120  # first compile of a JVM / Go / Rust toolchain on a loaded 2-core host
    if case == "print":
        r = call(url, lang, code, compile_timeout=ct, run_timeout=60)
        assert r.status == OK and r.run_result.stdout.strip() == "hello", r
    elif case == "echo":
        r = call(url, lang, code, stdin="echo me\n", compile_timeout=ct, run_timeout=60)
        assert r.status == OK and r.run_result.stdout.strip() == "echo me", r
    elif case == "rte":
        r = call(url, lang, code, compile_timeout=ct, run_timeout=60)
        assert r.status == FAILED, r
        assert r.run_result is not None and r.run_result.return_code != 0, r
    elif case == "cerr":
        r = call(url, lang, code, compile_timeout=ct, run_timeout=60)
        assert r.status == FAILED and r.run_result is None, r
        assert r.compile_result.status == sf.CommandRunStatus.Finished, r
        assert r.compile_result.return_code != 0, r
    elif case == "loop":
        r = call(url, lang, code, compile_timeout=ct, run_timeout=3)
        assert r.status == FAILED, r
        assert r.run_result.status == sf.CommandRunStatus.TimeLimitExceeded, r
    elif case == "mem":
        r = call(url, lang, code, compile_timeout=ct, run_timeout=60, memory_limit_MB=512)
        assert r.status == FAILED and r.run_result.return_code != 0, r
    elif case == "read":
        import base64
        r = call(url, lang, code, compile_timeout=ct, run_timeout=60,
                 files={IN_PATH: base64.b64encode(f"{IN_TEXT}\n".encode()).decode()})
        assert r.status == OK and r.run_result.stdout.strip() == IN_TEXT, r
    elif case == "write":
        import base64
        r = call(url, lang, code, compile_timeout=ct, run_timeout=60, fetch_files=["out.txt"])
        assert r.status == OK, r
        assert base64.b64decode(r.files["out.txt"]).decode() == OUT_TEXT, r
    elif case in ("pass", "fail"):
        r = call(url, lang, code, compile_timeout=ct, run_timeout=120)
        want = OK if case == "pass" else FAILED
        assert r.status == want, r
        assert r.run_result is not None, r
    else:
        raise ValueError(case)


PARAMS = [(lang, case) for lang, progs in P.items() for case in CASES
          if case in progs and progs[case] is not None]
PARAMS += [(lang, case) for lang in T for case in ("pass", "fail")]
COMPILED = {"cpp", "go", "java", "rust", "csharp", "scala", "verilog"}


@pytest.mark.parametrize("lang,case", PARAMS, ids=[f"{l}-{c}" for l, c in PARAMS])
def test_language_case(server, table, lang, case):
    row = table.get(lang)
    assert row is not None, f"{lang} missing from GET /v1/run_code/languages"
    cell = RESULTS.setdefault(lang, {})
    if not row["installed"]:
        cell[case] = "skip"
        pytest.skip(f"image {row['image']} is not installed (sandlot image build {row['image']})")
    code = (P.get(lang) or T[lang])[case]
    try:
        check(server.url, lang, lang in COMPILED, case, code)
    except BaseException:
        cell[case] = "FAIL"
        raise
    cell[case] = "pass"


def test_every_mode_is_in_the_table(table):
    assert set(P) | set(T) == set(table), set(table) ^ (set(P) | set(T))


def test_missing_image_is_sandbox_error_not_failed(server, table):
    missing = [l for l, row in table.items() if not row["installed"]]
    if not missing:
        pytest.skip("every toolchain image is installed")
    r = httpx.post(f"{server.url}/run_code", json={"code": "x", "language": missing[0]},
                   timeout=30).json()
    assert r["status"] == "SandboxError", r
    assert f"sandlot image build {table[missing[0]]['image']}" in r["message"], r


def test_language_absent_is_python(server):
    r = httpx.post(f"{server.url}/run_code", json={"code": "print(6 * 7)"}, timeout=60).json()
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "42\n", r


def test_zz_write_artifact_table():
    """Writes the language × case table of this run (after the cases above)."""
    cols = CASES + ["pass", "fail"]
    lines = ["# run_code languages × cases (sandbox-fusion client)", "",
             f"Written by tests/test_run_code_languages.py at "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
             "`—`: case does not apply to the language.", "",
             "| language | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for lang in list(P) + list(T):
        cells = [RESULTS.get(lang, {}).get(c, "—") for c in cols]
        lines.append(f"| {lang} | " + " | ".join(cells) + " |")
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    ARTIFACT.write_text("\n".join(lines) + "\n")


MIXED = [("python", 'print("py")\n', "py"), ("bash", "echo sh\n", "sh"),
         ("cpp", '#include <cstdio>\nint main(){puts("cc");}\n', "cc"),
         ("perl", 'print "pl\\n";\n', "pl"), ("go", P["go"]["print"], "hello"),
         ("java", P["java"]["print"], "hello"), ("nodejs", P["nodejs"]["print"], "hello"),
         ("rust", P["rust"]["print"], "hello")]


def test_128_concurrent_mixed_languages(server, table):
    """128 calls at once over the installed languages: each is its own correct answer or a
    fast 429/504 (never another call's output, never a SandboxError)."""
    jobs = [m for m in MIXED if table[m[0]]["installed"]]
    work = [(i, *jobs[i % len(jobs)]) for i in range(128)]

    def one(job):
        i, lang, code, want = job
        code = code.replace("hello", f"hello{i}") if want == "hello" else code
        want = f"hello{i}" if want == "hello" else want
        t0 = time.monotonic()
        resp = httpx.post(f"{server.url}/run_code",
                          json={"code": code, "language": lang, "compile_timeout": 120,
                                "run_timeout": 60}, timeout=600)
        return lang, want, resp, time.monotonic() - t0

    with ThreadPoolExecutor(128) as ex:
        out = list(ex.map(one, work))
    answered = 0
    for lang, want, resp, dt in out:
        if resp.status_code in (429, 504):
            assert resp.headers.get("retry-after") == "1", resp.headers
            assert dt < 30, (resp.status_code, dt)
            continue
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["status"] == "Success", (lang, body)
        assert body["run_result"]["stdout"].strip() == want, (lang, want, body)
        answered += 1
    assert answered > 0
