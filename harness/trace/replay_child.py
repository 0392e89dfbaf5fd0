"""The replay's child: ``python -m harness.trace.replay_child replay|shrink TRACE --out JSON``.

:mod:`harness.trace.replay` starts it on the traced server's own ``libllama.so`` (through the driver bound from
its tree's header, or llama-cpp-python's); it replays the trace (:class:`~harness.trace.replay_engine.Engine`, with
``--fresh`` every read also against a fresh sequential evaluation) and, for ``shrink``, shrinks it
(:func:`~harness.trace.shrink.shrink`) to the target given or the first divergence, writing the shrunk trace
to ``--shrunk``. Its JSON is the replay's summary and the shrink's (target, calls and rows left,
seconds, path).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from harness.child import child_setup
from harness.trace.calls import is_batch, read_trace, write_trace
from harness.trace.replay_engine import Engine, RunResult
from harness.trace.shrink import shrink
from harness.trees.api import loaded_libllama
from harness.trees.driver import libllama

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    child_setup(watchdog=False)
    ap = argparse.ArgumentParser(prog="python -m harness.trace.replay_child")
    ap.add_argument("action", choices=("replay", "shrink"))
    ap.add_argument("trace")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model")
    ap.add_argument("--ctx", type=int, default=None)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--target", help="KIND:I, e.g. fresh:1234 or ret:88 (shrink; default: the first divergence)")
    ap.add_argument("--shrunk", help="where the shrunk trace goes (shrink)")
    ap.add_argument("--budget", type=float, default=600.0)
    a = ap.parse_args(argv)
    trace = read_trace(a.trace)
    engine = Engine(trace, model=a.model, ctx=a.ctx)
    out: dict[str, Any] = {"trace": a.trace, "libllama": str(loaded_libllama() or ""), "driver": libllama().name,
                           "model": str(engine.model.path),
                           "torn": trace.torn, "truncated": trace.truncated}  # fmt: skip
    try:
        # a shrink with its target named starts from the target's slice: no replay of the whole trace first
        whole = not (a.action == "shrink" and a.target)
        res = engine.run(trace.events, fresh=a.fresh or a.action == "shrink") if whole else RunResult()
        out["replay"] = res.summary() if whole else None
        if a.action == "shrink":
            if a.target:
                k, _, i = a.target.partition(":")
                target = (k, int(i))
            elif res.rets:
                target = ("ret", res.rets[0][0])
            else:
                v = res.first_divergence()
                if v is None:
                    out["shrink"] = {"error": "the replay shows no divergence to shrink"}
                    return _write(a.out, out)
                target = ("fresh", v.i)
            t0 = time.monotonic()
            small = shrink(engine, trace.events, target, budget=a.budget)
            calls = [e for e in small if e.get("ev") != "ret"]
            n_rows = sum(len(e.get("tok") or []) for e in calls if is_batch(e))
            took = round(time.monotonic() - t0, 1)
            out["shrink"] = {"target": list(target), "calls": len(calls), "rows": n_rows, "seconds": took}
            if a.shrunk:
                write_trace([trace.events[0], *trace.of("model"), engine.params, *small], a.shrunk)
                out["shrink"]["trace"] = a.shrunk
    finally:
        engine.close()
    return _write(a.out, out)


def _write(path: str, out: dict[str, Any]) -> int:
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
