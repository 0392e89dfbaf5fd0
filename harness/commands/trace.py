"""``python -m harness trace record|replay|shrink``: what llama-server asks of libllama, replayed and shrunk.

``record`` runs the ``concurrent-output-divergence`` workload (:mod:`harness.load.traced`) on a
llama-server traced by the ``LD_PRELOAD`` interposer ``harness/trace/trace.c`` (every libllama call that
touches memory or state, every batch row, the logits read back; one JSON line per call, at most
``--max-bytes``), ``--rounds`` times or until an answer differs from a fresh single-slot server's, and
prints the trace, its size, the wrong answers and the line that replays it; ``--sequential`` sends
the same requests one at a time to a one-slot server with the prompt cache on (the cache path of
``greedy-flip-on-cache-path``, no concurrency), ``--flash-attn`` sets the server's ``-fa``. ``replay TRACE`` replays
the calls in one process through llama-cpp-python on the server's own ``libllama.so`` (``--lib-dir``;
the trace's model file, its context parameters, one thread) and compares every logits read with the
trace bit for bit (``--fresh``: and with a fresh sequential evaluation of the tokens its sequence
holds). ``shrink TRACE`` delta-debugs the calls and batch rows down to the fewest that still show the
first divergence (or ``--target fresh:I|ret:I``) and writes them to ``--out``.

Exit codes: ``record`` 1 when an answer was wrong; ``replay`` 1 when a read or a return value differs
from the trace, or (``--fresh``) a read's argmax from the fresh evaluation's; ``shrink`` 1 when a
divergence was shrunk (it stands), 0 when there is none; 2 usage, 3 the replay's child died, 4 the build.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fixtures.gguf import ARCHS, model_path
from harness.backends.llama_server.probe import probe
from harness.commands.common import add_server_options, resolve_server
from harness.errors import EXIT_FAILED, EXIT_OK, UsageError
from harness.load.traced import fresh_answers, record_concurrent, workload
from harness.trace.calls import DEFAULT_MAX_BYTES, read_trace
from harness.trace.replay import replay, replay_line, shrink_trace

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="record|replay|shrink", required=True)
    rec = sub.add_parser("record", help="a traced concurrent run on a real llama-server")
    rec.add_argument("--out", type=Path, required=True, help="the trace file (round R: OUT with .R before .jsonl)")
    add_server_options(rec, asan=False)  # a --server-bin must link libllama shared (a --source build does)
    rec.add_argument("--arch", choices=ARCHS, help="the generated fixture model (default llama)")
    rec.add_argument("--model", choices=ARCHS, help=argparse.SUPPRESS)  # the old spelling of --arch
    rec.add_argument("--seed", type=int, default=0, help="the workload's seed (0: the reproducer's)")
    rec.add_argument("--rounds", type=int, default=1, help="rounds on a new server each (default 1)")
    rec.add_argument("--until-wrong", action="store_true", help="stop at the first round with a wrong answer")
    rec.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="the trace's size cap")
    rec.add_argument("--sequential", action="store_true",
                     help="the cache path alone: one client, -np 1, --cache-ram 8 (greedy-flip-on-cache-path)")
    rec.add_argument("--flash-attn", choices=("on", "off", "auto"), help="the server's -fa (default: its own, auto)")
    for name, help_ in (("replay", "replay a trace in one process and compare its logits"),
                        ("shrink", "shrink a trace to the fewest calls that still diverge")):  # fmt: skip
        p = sub.add_parser(name, help=help_)
        p.add_argument("trace", type=Path)
        p.add_argument("--lib-dir", type=Path, help="the directory of the traced server's libllama.so")
        p.add_argument("--model", type=Path, help="the model file (default: the one the trace names)")
        if name == "replay":
            p.add_argument("--fresh", action="store_true", help="also compare with fresh sequential evaluations")
        else:
            p.add_argument("--target", help="fresh:I (read I unlike a fresh evaluation) or ret:I (call I's return)")
            p.add_argument("--out", type=Path, help="the shrunk trace (default: TRACE with .min before .jsonl)")
            p.add_argument("--budget", type=float, default=600.0, help="seconds (default 600)")


def _check_trace(path: Path) -> None:
    if not path.is_file():
        raise UsageError(f"{path}: no such trace file")
    t = read_trace(path)
    if not t.events or t.events[0].get("ev") != "trace":
        raise UsageError(f"{path}: not a libllama trace (no trace header line)")
    if not t.contexts():
        raise UsageError(f"{path}: the trace holds no context creation: nothing to replay")


def _record(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise UsageError("--rounds must be >= 1")
    build = resolve_server(args)
    print("  " + probe(build.binary).line(), file=sys.stderr)  # the request form its version answers
    if args.model is not None:
        if args.arch is not None:
            raise UsageError("--model is the old spelling of --arch; use --arch only")
        print(f"note: --model is deprecated for trace record; use --arch {args.model}", file=sys.stderr)
    model = model_path(args.arch or args.model or "llama")
    work = workload(args.seed)
    want = fresh_answers(build.binary, model, work, extra_args=["-fa", args.flash_attn] if args.flash_attn else [])
    wrong_rounds = 0
    for rnd in range(args.rounds):
        out = args.out if args.rounds == 1 else args.out.with_suffix(f".{rnd}{args.out.suffix}")
        extra = ["-fa", args.flash_attn] if args.flash_attn else []
        if args.sequential:
            r = record_concurrent(build.binary, model, [[x for c in work for x in c]], want, out, n_parallel=1,
                                  cache_ram=8, max_bytes=args.max_bytes, extra_args=extra)  # fmt: skip
        else:
            r = record_concurrent(build.binary, model, work, want, out, max_bytes=args.max_bytes, extra_args=extra)
        t = read_trace(out)
        print(f"round {rnd}: {r.answers} answers, {len(r.wrong)} wrong; trace {out}: {r.trace_bytes} bytes, "
              f"{len(t.events)} calls{' (TRUNCATED)' if t.truncated else ''}")  # fmt: skip
        for w in r.wrong:
            print(f"  wrong: {w}")
        if r.wrong:
            wrong_rounds += 1
            print(f"  replay and shrink: {replay_line(out, r.lib_dir)}")
            if args.until_wrong:
                break
    return EXIT_FAILED if wrong_rounds else EXIT_OK


def _print(d: dict[str, Any]) -> None:
    print(json.dumps(d, indent=1, default=str))


def run(args: argparse.Namespace) -> int:
    if args.action == "record":
        return _record(args)
    _check_trace(args.trace)
    lib = args.lib_dir
    if lib is not None and not (lib / "libllama.so").exists():
        raise UsageError(f"--lib-dir {lib}: no libllama.so there")
    if args.action == "replay":
        res = replay(args.trace, lib_dir=lib, model=args.model, fresh=args.fresh)
        _print(res)
        s = res["replay"]
        bad = s["reads_same"] != s["reads"] or s["rets_differ"] or (args.fresh and s["fresh_argmax_differ"])
        return EXIT_FAILED if bad else EXIT_OK
    out = args.out or args.trace.with_suffix(".min" + args.trace.suffix)
    res = shrink_trace(args.trace, lib_dir=lib, out=out, target=args.target, model=args.model, budget=args.budget)
    _print(res)
    return EXIT_FAILED if "calls" in res.get("shrink", {}) else EXIT_OK
