"""Python-allocator faults: ``_testcapi.set_nomemory`` fails any CPython allocation.

The model's seam fails only the allocations the C++ makes; this layer fails the interpreter's own
(object headers, dicts, tuples, digests), and so tests whether the model and the invariant checks
stay consistent when Python itself runs out of memory at any point of an act. Its findings are
about the model's exception safety: a Python ``MemoryError`` has no upstream counterpart at most
of these points, so nothing here is counted against either semantics.

What it promises:

* Hooks only ever run in a **child process** (``python -m faults.pymem --child``) under a watchdog
  (:func:`harness.child.run_child`): a hook left on can hang or abort the interpreter. The hook is
  installed right before the act and removed in ``finally``; the checks run with it removed.
* Trial ``nth`` fails allocation ``nth`` counted from the hook's installation (transient), or
  every allocation from ``nth`` on (persistent). Each trial has its own watchdog
  (``trial_timeout``): CPython under persistent failure mostly hangs, so the persistent pass
  samples a few points of the transient range. After a transient act that returned normally, a
  probe allocation under the still-installed hook tells whether allocation ``nth`` was reached:
  when the probe fails, the act made fewer than ``nth`` allocations and the transient sweep ends
  there. The persistent sweep covers the same points.
* A child that dies (SIGABRT from "Cannot recover from MemoryErrors", SIGSEGV) or hangs is an
  ``aborted`` (SIGABRT) or ``killed`` trial with the stacks the child wrote; the runner starts a
  new child at the next point.
* :func:`pymem_unavailable` says, in one line, why the layer cannot run (no ``_testcapi``, as in
  some distribution builds of CPython); :func:`sweep_pymem` then raises :class:`PymemUnavailable`.

Trial outcomes (:class:`faults.kinds.Outcome`): ``ok`` (the failure was not reached),
``accepted-error`` (reached, and either the act still gave the right result, detail ``absorbed``,
or a ``MemoryError`` escaped with every invariant holding afterwards, detail ``MemoryError at``),
``violation`` (a wrong result or a broken invariant, with or without a ``MemoryError``: the model is
not exception-safe there), ``crash`` (another exception escaped), ``killed`` (the child died or
hung; ``aborted`` when it died of SIGABRT, e.g. "Cannot recover from MemoryErrors").
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from faults.kinds import Outcome, died
from faults.scenarios import SCENARIOS
from harness.child import child_setup, child_stacks_file, run_child
from harness.errors import Unavailable
from properties.invariants import Shadow, Violation, check_state, clear_all

__all__ = ["PymemTrial", "PymemUnavailable", "pymem_unavailable", "sweep_pymem"]

_ROOT = str(Path(__file__).resolve().parent.parent)


class PymemUnavailable(Unavailable):
    """This interpreter cannot fail its own allocations on demand."""


def _testcapi() -> ModuleType | None:
    try:
        mod = importlib.import_module("_testcapi")
    except ImportError:
        return None
    return mod if hasattr(mod, "set_nomemory") and hasattr(mod, "remove_mem_hooks") else None


def pymem_unavailable() -> str | None:
    """``None`` when the layer can run, else the reason in one line."""
    if _testcapi() is None:
        return (
            f"the pymem fault layer needs CPython's _testcapi.set_nomemory, which {sys.executable} does not "
            "provide (install the interpreter's test module, e.g. Debian's libpython3.X-testsuite)"
        )
    return None


@dataclass
class PymemTrial:
    nth: int
    mode: str
    outcome: Outcome
    detail: str = ""
    stacks: str = ""
    reached: bool = True

    def row(self) -> dict[str, object]:
        return {"nth": self.nth, "mode": self.mode, "outcome": self.outcome, "detail": self.detail}


@dataclass
class PymemReport:
    scenario: str
    semantics: str
    trials: list[PymemTrial] = field(default_factory=list)

    @property
    def findings(self) -> list[PymemTrial]:
        return [t for t in self.trials if t.outcome.failed]


def sweep_pymem(
    scenario: str,
    semantics: str = "shared",
    *,
    max_points: int = 5000,
    first: int = 1,
    persistent_samples: int = 8,
    trial_timeout: float = 2.0,
    timeout: float = 120.0,
) -> PymemReport:
    """Fail Python allocation ``first, first+1, ...`` of ``scenario``'s act, in children.

    The transient sweep stops at the first point the act does not reach (or after ``max_points``).
    Persistent failure makes CPython itself hang or abort at most points, and each hang costs
    ``trial_timeout``; so the persistent pass runs ``persistent_samples`` points spread evenly over
    the transient range (0: none).
    """
    reason = pymem_unavailable()
    if reason is not None:
        raise PymemUnavailable(reason)
    if scenario not in SCENARIOS:
        raise KeyError(f"unknown scenario {scenario!r}")
    report = PymemReport(scenario, semantics)
    transient = _run_points(report, "transient", list(range(first, first + max_points)), trial_timeout, timeout)
    reached = [t.nth for t in transient if t.reached]
    if persistent_samples > 0 and reached:
        step = max(1, len(reached) // persistent_samples)
        _run_points(report, "persistent", reached[::step][:persistent_samples], trial_timeout, timeout)
    return report


def _run_points(
    report: PymemReport, mode: str, points: list[int], trial_timeout: float, timeout: float
) -> list[PymemTrial]:
    """Run ``points`` in as many children as it takes; a dead child's point becomes ``killed`` or ``aborted``."""
    out: list[PymemTrial] = []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    while points:
        spec = {
            "scenario": report.scenario,
            "semantics": report.semantics,
            "mode": mode,
            "points": points,
            "trial_timeout": trial_timeout,
        }
        argv = [sys.executable, "-m", "faults.pymem", "--child", json.dumps(spec)]
        child = run_child(argv, env=env, timeout=timeout)
        got = [_trial(json.loads(line)) for line in child.stdout.splitlines() if line.startswith("{")]
        out.extend(got)
        if got and not got[-1].reached:
            break
        points = points[len(got) :]
        if not points:
            break
        if child.crashed or child.returncode != 0:
            hung = "Timeout (" in child.stacks
            what = f"hung (watchdog after {trial_timeout}s)" if hung else f"child {child.describe()}"
            out.append(PymemTrial(points[0], mode, died(child), f"{what}: {child.stderr.strip()[-200:]}", child.stacks))
            points = points[1:]
    report.trials.extend(out)
    return out


def _trial(row: dict[str, object]) -> PymemTrial:
    return PymemTrial(**{**row, "outcome": Outcome(row["outcome"])})  # type: ignore[arg-type]


# ---- child side ---------------------------------------------------------------------------------


def _child_trial(capi: ModuleType, scenario: str, semantics: str, mode: str, nth: int) -> PymemTrial:

    prepared = SCENARIOS[scenario].build(semantics)
    server = prepared.server
    shadow = Shadow()
    check_state(server, shadow)
    set_nomemory, remove = capi.set_nomemory, capi.remove_mem_hooks
    escaped: BaseException | None = None
    value: object = None
    reached = True
    gc.collect()
    gc.disable()
    set_nomemory(nth - 1, 0 if mode == "persistent" else nth)
    try:
        try:
            value = prepared.act()
        except BaseException as e:
            escaped = e
        if escaped is None and mode == "transient":
            try:
                bytearray(64)  # the probe: fails only if allocation nth is still pending
            except MemoryError:
                reached = False
    finally:
        remove()
        gc.enable()
    if not reached:
        return PymemTrial(nth, mode, Outcome.OK, "allocation not reached", reached=False)
    integrity = ""
    try:
        if escaped is None and (err := prepared.check(value, False)) is not None:
            integrity = err
        check_state(server, shadow)
        clear_all(server)
    except Violation as v:
        integrity = integrity or str(v)
    if escaped is None:
        if integrity:
            return PymemTrial(nth, mode, Outcome.VIOLATION, integrity)
        return PymemTrial(nth, mode, Outcome.ACCEPTED, "absorbed: reached; the act completed with the right result")
    where = _where(escaped)
    if not isinstance(escaped, MemoryError):
        return PymemTrial(nth, mode, Outcome.CRASH, f"{type(escaped).__name__}: {escaped} at {where}")
    if integrity:
        return PymemTrial(nth, mode, Outcome.VIOLATION, f"MemoryError at {where}, then {integrity}")
    return PymemTrial(nth, mode, Outcome.ACCEPTED, f"MemoryError at {where}; invariants hold")


def _where(e: BaseException) -> str:
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return "?"
    code = last.tb_frame.f_code
    return f"{Path(code.co_filename).name}:{last.tb_lineno} ({code.co_name})"


def _child_main(spec_text: str) -> int:
    child_setup(watchdog=False)
    capi = _testcapi()
    if capi is None:
        print(pymem_unavailable(), file=sys.stderr)
        return 2
    spec = json.loads(spec_text)
    for nth in spec["points"]:
        # a per-trial watchdog: a hook that hangs the interpreter ends the child with the stacks
        faulthandler.dump_traceback_later(spec["trial_timeout"], exit=True, file=child_stacks_file())
        t = _child_trial(capi, spec["scenario"], spec["semantics"], spec["mode"], nth)
        faulthandler.cancel_dump_traceback_later()
        print(json.dumps({**t.row(), "reached": t.reached}), flush=True)
        if not t.reached:
            break
    return 0


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--child":
        return _child_main(argv[1])
    scenario = argv[0] if argv else "save-with-checkpoints"
    semantics = argv[1] if len(argv) > 1 else "shared"
    reason = pymem_unavailable()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    r = sweep_pymem(scenario, semantics)
    tally = Counter(t.outcome for t in r.trials)
    print(f"pymem {scenario} ({semantics}): {len(r.trials)} trials: " + ", ".join(f"{n} {o}" for o, n in tally.items()))
    for t in r.findings[:10]:
        print(f"  {t.mode} #{t.nth}: {t.outcome}: {t.detail}")
    return 1 if r.findings else 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
