"""CI check: the server gate on the ``master`` build fails exactly where PR #27451 says master is wrong.

Usage: ``python -m ci.expect_master artifacts/gate-server-master.json EXIT_CODE``. Passes (exit 0)
when the gate exited non-zero, every failure is one of the PR's claims (the transient peak of a
save carries the checkpoint copy; a bad_alloc in that copy escapes and kills the server) and both
claims were shown; otherwise prints what is wrong and exits 1.
"""

from __future__ import annotations

import json
import sys

PR_CLAIMS = {"transient_peak", "no_partial_entries"}


def main(argv: list[str]) -> int:
    path, rc = argv[0], int(argv[1])
    with open(path) as f:
        data = json.load(f)
    props = {f["property"] for f in data["failures"]}
    problems = []
    if rc == 0:
        problems.append("the master gate passed, but master is expected to fail the PR's claims")
    if props - PR_CLAIMS:
        problems.append(f"failures outside the PR's claims: {sorted(props - PR_CLAIMS)}")
    if PR_CLAIMS - props:
        problems.append(f"PR claims not shown on master: {sorted(PR_CLAIMS - props)}")
    for p in problems:
        print(f"expect_master: {p}")
    if not problems:
        print(f"expect_master: master fails exactly the PR's claims ({', '.join(sorted(props))}), exit {rc}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
