"""The exploration case's call counts, each pair in a fresh interpreter.

``python -m harness.bench.calls CLASS EXAMPLES SEED`` prints two numbers: the Python function calls
(:mod:`cProfile`) of the gate machine ``CLASS`` under the ci profile, as the gate runs it, and of
Hypothesis alone on the same programs (:func:`harness.bench.baselines.empty_machine`, its
preconditions' answers replayed from a first run through :func:`~harness.bench.baselines.recording`
that is not counted).
A count depends on what the process did before it (module-level counters such as the timing sample
of ``properties.invariants`` decide which wrappings are timed), so the bench runs this module as a child
(:func:`harness.child.run_child`): a fresh process makes the pair the same on every run for a seed,
to within a few calls of Hypothesis' own that vary from run to run (4 in 273645 at 5 examples).
"""

from __future__ import annotations

import cProfile
import pstats
import sys
from collections.abc import Sequence

from hypothesis.stateful import RuleBasedStateMachine

from harness.bench.baselines import PreconditionTape, empty_machine, recording
from harness.errors import EXIT_USAGE, HarnessError, UsageError
from properties.machine import machine_class
from properties.run import machines_for, make_settings, run_seeded

__all__ = ["count", "main"]


def count(class_name: str, examples: int, seed: int) -> tuple[int, int]:
    """Calls of the machine ``class_name`` and of Hypothesis alone on its programs (one seeded run each)."""
    configs = {c.class_name: c for c in machines_for("shared", "ci")}
    if class_name not in configs:
        raise UsageError(f"no gate machine {class_name!r}; the ci profile has {', '.join(configs)}")
    cls, tape = machine_class(configs[class_name]), PreconditionTape()
    cfg_settings = make_settings("ci", None, examples)

    def counted(machine: type[RuleBasedStateMachine]) -> int:
        prof = cProfile.Profile()
        prof.runcall(run_seeded, machine, cfg_settings, seed)
        return int(pstats.Stats(prof).total_calls)  # type: ignore[attr-defined]

    run_seeded(recording(cls, tape), cfg_settings, seed)  # not counted: the gate runs no recorder
    m_calls = counted(cls)
    r_calls = counted(empty_machine(cls, f"{class_name}_programs", tape))
    tape.finish()
    return m_calls, r_calls


def main(argv: Sequence[str]) -> int:
    if len(argv) != 3 or not argv[1].isdigit() or not argv[2].isdigit():
        print("usage: python -m harness.bench.calls CLASS EXAMPLES SEED", file=sys.stderr)
        return EXIT_USAGE
    try:
        m_calls, r_calls = count(argv[0], int(argv[1]), int(argv[2]))
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(m_calls, r_calls)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
