"""Hypothesis-generated request programs against a real ``llama-server``: the driver the generated
differentials share (``slot-files --differential``, ``reuse``).

A differential's example is an abstract program (what Hypothesis draws and shrinks: small integers) that
its runner turns into concrete requests while it runs them (a prompt may extend what the server generated).
:func:`run_generated` runs ``examples`` of them under ``seed`` (``hypothesis.seed``: a seed gives the same
examples on every machine; no example database), and on a failure lets Hypothesis shrink it, at most
``shrinks`` times (every try starts servers), keeping the concrete program and message of the last failing
run: Hypothesis runs the smallest failing example last, so that is the shrunk program. The caller prints it
with the seed and the command line that replays the run. :func:`output_verdict` judges an answer against a fresh
cache-less server as the concurrent differential and the soak do (:func:`~harness.load.outputs.compare_output`): a
greedy flip within the model's batch-shape bound is a registered finding (none for mamba: no attention layer).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine as _engine

from harness.errors import PropertyFailure
from harness.load.outputs import Divergences, compare_output
from harness.targets.llama_server import RequestFailed, ServerProcess
from properties.run import SHRINKS

__all__ = ["GeneratedFailure", "GeneratedFigures", "Outcome", "failed_request", "output_verdict", "run_generated"]


class GeneratedFigures:
    """A model's figures of a generated run (a dataclass with ``findings``, a ``Counter``, and ``failure``)."""

    findings: Counter[str]
    failure: GeneratedFailure | None

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k not in ("failure", "findings")}
        d["findings"] = dict(sorted(self.findings.items()))
        if self.failure is not None:
            d["failure"] = {"check": self.failure.name, "message": self.failure.message,
                            "program": self.failure.program}  # fmt: skip
        return d


class GeneratedFailure(PropertyFailure):
    """A generated program the server and the model (or a fresh evaluation) disagree on: ``name`` the property,
    ``program`` the concrete program as pasteable Python that replays it (paste it into ``python`` from the
    repository root, fix what it shows, paste it again)."""

    def __init__(self, name: str, message: str, program: str) -> None:
        super().__init__(name, message, f"{name}: {message}")
        self.program = program


@dataclass
class Outcome:
    """A generated run: the examples run (shrink tries included) and the shrunk failure, if any."""

    examples: int = 0
    failure: GeneratedFailure | None = None
    first: GeneratedFailure | None = None  # the failure as first found, before shrinking


@contextmanager
def _shrinks(limit: int | None) -> Iterator[None]:
    """Hypothesis' shrinker stopped after ``limit`` shrinks (``engine.MAX_SHRINKS``, as
    :func:`properties.run.run_seeded` does for the machines); None: Hypothesis' own limit."""
    eng: Any = _engine
    old = getattr(eng, "MAX_SHRINKS", None)
    if limit is None or not isinstance(old, int):
        yield
        return
    eng.MAX_SHRINKS = limit
    try:
        yield
    finally:
        eng.MAX_SHRINKS = old


def failed_request(e: RequestFailed) -> str:
    """The failure a request that got no usable answer is: the server died (``server_crash``), did not answer in
    time (``hang``) or answered an error (``http_error``)."""
    return "server_crash" if not e.alive else "hang" if e.kind == "timeout" else "http_error"


def run_generated(
    strategy: st.SearchStrategy[Any],
    run_one: Callable[[Any], None],
    *,
    examples: int,
    seed_value: int,
    shrinks: int | None = SHRINKS["ci"],
) -> Outcome:
    """Run ``run_one`` on ``examples`` programs drawn from ``strategy``; it raises :class:`GeneratedFailure`."""
    out = Outcome()

    @seed(seed_value)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False, print_blob=False,
              phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck),
              report_multiple_bugs=False)  # fmt: skip
    @given(strategy)
    def test(program: Any) -> None:
        out.examples += 1
        try:
            run_one(program)
        except GeneratedFailure as e:
            out.first = out.first or e
            out.failure = e
            raise

    with _shrinks(shrinks):
        try:
            test()
        except Exception:  # the shrunk failure, or Hypothesis' Flaky when a real server's replay did not fail again
            if out.failure is None:
                raise
    return out


def output_verdict(fresh: ServerProcess, tokens: tuple[int, ...], generated: tuple[int, ...], cache_n: int,
                   arch: str) -> tuple[str | None, str | None]:  # fmt: skip
    """An answer against ``fresh``'s: ``("", None)`` equal, ``(finding, None)`` a greedy flip within the model's
    :data:`~harness.findings.BATCH_SHAPE_FLIP_GAP` (``greedy-flip-on-cache-path`` with ``cache_n`` > 0, else
    ``concurrent-output-divergence``: :meth:`~harness.load.outputs.Divergences.batch_shape`), or ``(None, what
    differs)``."""
    diff = compare_output(fresh, tokens, generated, arch) if generated else None
    if diff is None:
        return "", None
    found = Divergences.batch_shape(diff, cache_n)
    return (found, None) if found is not None else (None, f"cache_n {cache_n}: {diff.describe()}")
