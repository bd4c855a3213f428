#!/usr/bin/env python3
"""A multi-language code-RL reward through Sandlot's `run_code` (async SDK).

A reward function as RL trainers write it: each sample is (language, program, tests as
stdin/expected-stdout pairs); the reward is the fraction of tests whose stdout matches.
Every test is one `client.run_code` call, all run concurrently with a bound. A language
whose toolchain image is not installed on the node (`GET /v1/run_code/languages`) is
skipped and named; a `SandboxError` (Sandlot's failure, not the program's) is retried once
and otherwise reported, never scored as 0, so infrastructure trouble cannot pose as a wrong
answer.

The built-in samples solve one problem (read n, print the sum 1..n) in several languages,
each with a correct and a wrong solution: a correct one must score 1.0, a wrong one 0.0.

Usage:
    python3 examples/multi_language_reward.py [--url http://127.0.0.1:7070] [--concurrency 16]
Exit status: 0 when every scored sample got its expected reward and no call raised; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "sdk" / "python"))
import sandlot.aio  # noqa: E402

TESTS: List[Tuple[str, str]] = [("1\n", "1"), ("4\n", "10"), ("100\n", "5050")]


@dataclass
class Sample:
    """One policy output to score: ``expected`` is the reward a correct scorer must give."""

    language: str
    code: str
    expected: float


def samples() -> List[Sample]:
    """A correct (1.0) and a wrong (0.0: off by one) solution per language."""
    progs: Dict[str, str] = {
        "python": "n = int(input())\nprint(sum(range(1, n + {k})))\n",
        "cpp": "#include <iostream>\nint main(){long n;std::cin>>n;long s=0;"
               "for(long i=1;i<n+{k};i++)s+=i;std::cout<<s<<std::endl;}\n",
        "java": "import java.util.*;\npublic class Main{public static void main(String[] a){"
                "long n=new Scanner(System.in).nextLong();long s=0;for(long i=1;i<n+{k};i++)s+=i;"
                "System.out.println(s);}}\n",
        "go": "package main\nimport \"fmt\"\nfunc main(){var n int;fmt.Scan(&n);s:=0;"
              "for i:=1;i<n+{k};i++{s+=i};fmt.Println(s)}\n",
        "rust": "use std::io::*;\nfn main(){let mut t=String::new();stdin().read_line(&mut t).unwrap();"
                "let n:i64=t.trim().parse().unwrap();let s:i64=(1..n+{k}).sum();println!(\"{}\",s);}\n",
        "nodejs": "const n=parseInt(require('fs').readFileSync(0,'utf8'));let s=0;"
                  "for(let i=1;i<n+{k};i++)s+=i;console.log(s);\n",
        "bash": "read n; s=0; for ((i=1;i<n+{k};i++)); do s=$((s+i)); done; echo $s\n",
    }
    out = []
    for lang, tmpl in progs.items():
        out.append(Sample(lang, tmpl.replace("{k}", "1"), 1.0))
        out.append(Sample(lang, tmpl.replace("{k}", "0"), 0.0))
    return out


async def run_test(client: "sandlot.aio.AsyncClient", sem: asyncio.Semaphore, s: Sample,
                   stdin: str) -> Optional[str]:
    """stdout of one run, or None when Sandlot failed twice (SandboxError)."""
    for _ in range(2):
        async with sem:
            r = await client.run_code(s.code, language=s.language, stdin=stdin,
                                      compile_timeout=60, run_timeout=10)
        if r.status != "SandboxError":
            return (r.run_result.stdout or "") if r.status == "Success" and r.run_result else ""
    return None


async def reward(client: "sandlot.aio.AsyncClient", sem: asyncio.Semaphore, s: Sample,
                 tests: Sequence[Tuple[str, str]] = TESTS) -> Optional[float]:
    """Fraction of ``tests`` passed, or None when Sandlot could not give a verdict."""
    outs = await asyncio.gather(*(run_test(client, sem, s, i) for i, _ in tests))
    if any(o is None for o in outs):
        return None
    return sum(o.strip() == want for o, (_, want) in zip(outs, tests)) / len(tests)


async def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=os.environ.get("SANDLOT_URL", "http://127.0.0.1:7070"))
    ap.add_argument("--concurrency", type=int, default=16)
    a = ap.parse_args(argv)
    async with sandlot.aio.AsyncClient(a.url, timeout=30) as client:
        installed = {l.language for l in await client.run_code_languages() if l.installed}
        todo = [s for s in samples() if s.language in installed]
        skipped = sorted({s.language for s in samples()} - installed)
        sem = asyncio.Semaphore(a.concurrency)
        got = await asyncio.gather(*(reward(client, sem, s) for s in todo))
    ok = True
    for s, r in zip(todo, got):
        ok &= r == s.expected
        if r is None:
            print(f"{s.language:10} expected {s.expected:.1f}: no verdict (SandboxError twice)")
        else:
            print(f"{s.language:10} expected {s.expected:.1f} got {r:.2f} "
                  f"{'ok' if r == s.expected else 'WRONG'}")
    if skipped:
        print(f"skipped (toolchain image not installed): {', '.join(skipped)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
