"""``python -m harness oom``: PR #27451's save with big checkpoints under a real memory limit, per build.

For each build (the pinned tree with the PR, ``shared``; the pinned tree, ``master``; and a user's tree with
``--source``) and each kind of limit (``--mode cgroup``: a memory cgroup's hard limit, the OOM killer;
``rlimit``: ``RLIMIT_AS``, a ``std::bad_alloc``; ``none``: the cgroup without a limit, to see the whole save's
peak and time), a slot builds up ``--checkpoints`` checkpoints of ``--size``
MiB, the limit is set to ``baseline + S + C/2`` from what was measured, another prompt forces the save, and a
next request must resume from the cache (:mod:`harness.backends.llama_server.oom`). The table says per run
what was observed: survived, OOM-killed, aborted or recovered; the save's peak and time; ``cache_n``.

Exit 0 when every build did what PR #27451 says (the PR survives and resumes; master is OOM-killed in a
cgroup and aborts on the escaping bad_alloc under RLIMIT_AS; a ``--source`` tree as its semantics say),
1 when one did not, 3 when a server died of something else, 5 when no memory cgroup can be made here
(``--mode cgroup``), 2 on a usage error, 4 when a build fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path

from fixtures.gguf import CHECKPOINT_MIBS
from harness.backends.llama_server.oom import MODES, OomRun, OomSettings, expected, run_oom
from harness.backends.llama_server.probe import probe
from harness.commands.common import add_server_options, resolve_servers
from harness.errors import EXIT_CRASH, EXIT_FAILED, EXIT_OK
from harness.memlimit import MemoryCgroup, cgroup_support

__all__ = ["add_arguments", "run"]

MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoints", type=int, default=4, metavar="N", help="checkpoints in the slot (4)")
    sizes = ", ".join(map(str, CHECKPOINT_MIBS))
    parser.add_argument("--size", type=int, default=128, choices=CHECKPOINT_MIBS, metavar="MIB",
                        help=f"one checkpoint's size in MiB, one of {sizes} (128)")  # fmt: skip
    parser.add_argument("--mode", choices=(*MODES, "both", "all"), default="cgroup",
                        help="cgroup: a memory cgroup's hard limit (the OOM killer); rlimit: RLIMIT_AS "
                        "(a bad_alloc); none: no limit (the whole save's peak and time); both: cgroup and "
                        "rlimit; all: the three (default cgroup)")  # fmt: skip
    add_server_options(parser, several="add")  # the pinned builds --semantics names, and --source's tree
    parser.add_argument("--headroom", type=float, default=0.5,
                        help="limit = baseline + S + HEADROOM x C (0.5)")  # fmt: skip
    parser.add_argument("--ceiling-gib", type=float, default=10.0,
                        help="the cgroup's limit before the real one is set (10): the machine is shared")  # fmt: skip
    parser.add_argument("--keep-logs", metavar="DIR", type=Path, help="write the servers' logs here and keep them")
    parser.add_argument("--json", metavar="PATH", help="write every run's figures as JSON")


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.0f}"


def _row(r: OomRun) -> list[str]:
    resumed = "-" if r.resumed is None else (f"yes ({r.cache_n})" if r.resumed else f"no ({r.cache_n})")
    sig = r.exit_signal or ("alive" if r.exit_code is None else f"exit {r.exit_code}")
    build = r.build if r.build in ("pr", "master") else f"{r.build} [{r.semantics}]"  # a tree: what was read
    return [
        build, r.mode, f"{r.n_checkpoints}x{r.checkpoint_mib_log:.1f}", _mib(r.c_bytes),
        _mib(r.s_log_bytes or r.s_bytes), _mib(r.baseline_bytes), _mib(r.limit_bytes), r.outcome, sig,
        "-" if r.oom_kills is None else str(r.oom_kills), r.bad_alloc,
        _mib(r.peak_above_baseline), _mib(r.vmhwm_above_rss),
        "-" if r.save_wall_s is None else f"{r.save_wall_s:.1f}",
        "-" if r.save_update_ms is None else f"{r.save_update_ms:.0f}", resumed,
    ]  # fmt: skip


_HEAD = ["build", "mode", "ckpts MiB", "C", "S", "baseline", "limit MiB", "outcome", "signal", "oom_kill",
         "bad_alloc", "peak+", "VmHWM+", "save s", "update ms", "resumed (cache_n)"]  # fmt: skip


def _table(runs: list[OomRun]) -> str:
    rows = [_HEAD, *(_row(r) for r in runs)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEAD))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def run(args: argparse.Namespace) -> int:
    st = OomSettings(checkpoints=args.checkpoints, size_mib=args.size, mode="cgroup", headroom=args.headroom,
                     ceiling_gib=args.ceiling_gib)  # fmt: skip
    st.check()
    modes = {"both": ["cgroup", "rlimit"], "all": ["none", "cgroup", "rlimit"]}.get(args.mode, [args.mode])
    if "cgroup" in modes or "none" in modes:
        support = cgroup_support()
        if support is None:
            MemoryCgroup().create()  # raises the one line saying why neither cgroup version is usable (exit 5)
        else:
            print(f"memory cgroup v{support[0]} under {support[1]}", file=sys.stderr)

    def log(m: str) -> None:
        print("  build: " + m, file=sys.stderr)

    builds = [(choice.semantics, choice.build(log)) for choice in resolve_servers(args, "add")]
    for _, b in builds:
        print("  " + probe(b.binary, log=log).line(), file=sys.stderr)

    logs = args.keep_logs or Path(tempfile.mkdtemp(prefix="oom-"))
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[OomRun] = []
    print(f"oom: {st.checkpoints} checkpoints of {st.size_mib} MiB, limit = baseline + S + {st.headroom:g} x C, "
          f"modes {', '.join(modes)}, builds {', '.join(b.label for _, b in builds)}")  # fmt: skip
    failed = True
    try:
        for sem, b in builds:
            for mode in modes:
                r = run_oom(b.binary, b.label, sem, dataclasses.replace(st, mode=mode), logs,
                            progress=lambda m: print("  " + m, file=sys.stderr))  # fmt: skip
                runs.append(r)
                print(f"  {r.build} {r.mode}: {r.outcome} (expected {expected(sem, mode)})"
                      + (f"; {'; '.join(r.notes)}" if r.notes else ""), file=sys.stderr)  # fmt: skip
        print(_table(runs))
        bad = [
            r for r in runs if r.outcome != expected(r.semantics, r.mode) or (r.semantics == "shared" and not r.resumed)
        ]
        died = [r for r in runs if r.outcome == "died"]
        if args.json:
            report = {
                "command": "oom",
                "checkpoints": st.checkpoints,
                "size_mib": st.size_mib,
                "headroom": st.headroom,
                "runs": [r.to_json() for r in runs],
                "passed": not bad,
            }
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        for r in bad:
            print(f"FAIL: {r.build} under {r.mode}: {r.outcome}"
                  + ("" if r.outcome != expected(r.semantics, r.mode) else ", did not resume from the cache")
                  + f", expected {expected(r.semantics, r.mode)} (log: {r.log_path})")  # fmt: skip
        failed = bool(bad)
        if died:
            return EXIT_CRASH
        if bad:
            return EXIT_FAILED
        said = {"none": "without a limit every save completes", "cgroup": "in a cgroup master is OOM-killed",
                "rlimit": "under RLIMIT_AS master aborts"}  # fmt: skip
        limited = "; the PR's save fits and its next request resumes from the cache" if set(modes) - {"none"} else ""
        print("PASS: every build did what PR #27451 says: " + "; ".join(said[m] for m in modes) + limited)
        return EXIT_OK
    finally:
        if failed or args.keep_logs:
            print(f"server logs in {logs}", file=sys.stderr)
        else:
            shutil.rmtree(logs, ignore_errors=True)
