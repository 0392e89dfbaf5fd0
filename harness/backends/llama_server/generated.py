"""Hypothesis-generated request programs against a real ``llama-server``: the driver the generated
differentials share (``slot-files --differential``, ``reuse``).

A differential's example is an abstract program (what Hypothesis draws and shrinks: small integers) that
its runner turns into concrete requests while it runs them (a prompt may extend what the server generated).
:func:`run_generated` runs ``examples`` of them under ``seed`` (``hypothesis.seed``: a seed gives the same
examples on every machine; no example database), and on a failure lets Hypothesis shrink it, at most
``shrinks`` times (every try starts servers), keeping the concrete program and message of the last failing
run: Hypothesis runs the smallest failing example last, so that is the shrunk program. The caller prints it
with the seed and the command line that replays the run. :func:`output_verdict` judges an answer against a fresh
cache-less server as the backend's differential does (:func:`~harness.backends.llama_server.differential.check_output`),
excusing a near tie only on a model with a batch-shape bound (none for mamba: no attention layer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine as _engine

from harness.backends.llama_server.differential import Row, check_output
from harness.findings import BATCH_SHAPE_FLIP_GAP
from harness.targets.llama_server import ServerProcess
from properties.run import SHRINKS

__all__ = ["GeneratedFailure", "Outcome", "output_verdict", "run_generated"]


class GeneratedFailure(Exception):
    """A generated program the server and the model (or a fresh evaluation) disagree on: ``name`` the check,
    ``program`` the concrete program as pasteable Python that replays it."""

    def __init__(self, name: str, message: str, program: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name, self.message, self.program = name, message, program


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
    """An answer against ``fresh``'s: ``("", None)`` equal, ``(finding, None)`` a near tie a registered finding
    explains (``greedy-flip-on-cache-path`` with ``cache_n`` > 0, else ``concurrent-output-divergence``), or
    ``(None, what differs)``."""
    row = Row(tokens, max(1, len(generated)), 0, cache_n, 0, cache_n, generated)
    out = check_output(fresh, row)
    if out is None:
        return "", None
    if out == "near-tie" and arch in BATCH_SHAPE_FLIP_GAP:
        return ("greedy-flip-on-cache-path" if cache_n > 0 else "concurrent-output-divergence"), None
    return None, f"{row.describe()}: a near tie on a model without attention" if out == "near-tie" else out
