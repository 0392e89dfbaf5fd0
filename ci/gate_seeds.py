"""Run the synthetic gate's ci profile over many seeds and tabulate the verdicts.

Usage: ``python -m ci.gate_seeds [--seeds 0-99] [--semantics shared] [--out DIR]``. Each seed runs
``python -m harness gate --backend synthetic --seed N --json DIR/seed-N.json`` in its own process,
one after another (a seed takes 30-60 s on one core). A seed passes when the gate passes; known
findings are reported by the gate and never fail it. Prints one line per seed (``pass`` or the
failing property, machine and message) and exits 1 if any seed failed.

A seed whose JSON already exists in ``DIR`` is not run again (``--rerun`` to force), so an
interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# the few seeds CI runs (issue 12): 5 is the seed (its iswa machine reaches the
# stale-checkpoint-after-miss state and the excuse); 3 reached the refresh-onto-an-older-checkpoint
# model bug; 0's known-finding runs reproduce all four known findings
CI_SEEDS = (0, 3, 5)


def parse_seeds(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def run_seed(seed: int, semantics: str, out: Path, rerun: bool = False) -> dict:
    path = out / f"seed-{seed}.json"
    if rerun or not path.is_file():
        cmd = [sys.executable, "-m", "harness", "gate", "--backend", "synthetic", "--semantics", semantics]
        cmd += ["--seed", str(seed), "--json", str(path)]
        with open(out / f"seed-{seed}.out", "w") as log:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy(), check=False)
    if not path.is_file():
        return {"passed": False, "failures": [{"property": "error", "machine": "-", "message": "no JSON report"}]}
    return json.loads(path.read_text())


def verdict(report: dict) -> str:
    if report.get("passed"):
        return "pass"
    f = (report.get("failures") or [{}])[0]
    return f"FAIL {f.get('property')} in {f.get('machine')}: {str(f.get('message'))[:120]}"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ci.gate_seeds", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-99", metavar="LIST", help="seeds to run: 0-99, 3,5 or a mix (default 0-99)")
    ap.add_argument("--semantics", default="shared", choices=["shared", "master"],
                    help="the gate's semantics (default shared)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("artifacts/gate-seeds"), metavar="DIR",
                    help="one seed-N.json per seed, kept: a seed already there is not run again "
                    "(default artifacts/gate-seeds)")  # fmt: skip
    ap.add_argument("--rerun", action="store_true", help="run seeds whose JSON already exists again")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for seed in parse_seeds(args.seeds):
        v = verdict(run_seed(seed, args.semantics, args.out, args.rerun))
        failed += v != "pass"
        print(f"seed {seed:3}: {v}", flush=True)
    print(f"{failed} failing seed(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
