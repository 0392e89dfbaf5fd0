"""One repetition of the exploration case: its four arms in four interpreters, timed in turns on one CPU.

The arms of a gate machine (``CLASS``, ci profile, one seed):

* ``machine``: the machine as the gate runs it;
* ``replay``: Hypothesis alone on the same programs (:func:`harness.bench.baselines.empty_machine`
  with the machine's preconditions' answers replayed from a tape);
* ``trivial``: :data:`harness.bench.baselines.TrivialMachine` (every rule always valid);
* ``off``: the machine with ``checks_on`` False (no state invariant, no post-condition).

Each arm is a child, ``python -m harness.bench.arms ARM CLASS EXAMPLES SEED``. It first runs the
machine with a recorder (:func:`harness.bench.baselines.recording`): that is the replay's tape and
the statuses every arm's timed run must repeat, and it warms every arm the same way (the same imports,
code paths and heap growth before the clock starts). Then it prints ``ready`` and stops itself
(``SIGSTOP``). :func:`run_arms` pins the four stopped children to one CPU and resumes them one at a
time for :data:`SLICE` seconds each, round-robin, until each has printed its result: CPU seconds of
its timed run (``time.process_time``), its Hypothesis statistics split (whose wall-clock seconds are
scaled to the run's CPU: the clock runs on while an arm waits for its turn) and the tape's length.

Why turns, not one arm after the other in the bench's process: on this VM the same run's CPU time
moves by +-10% within seconds (the neighbours), so a ratio of two runs made 4 s apart moved by +-0.15
(np3: 0.71 .. 0.88 in one bench run), and a run's median by up to 0.09 from one run to the next. Arms
that take turns of 50 ms see the same host: np3's ratio moved by +-0.01 over six repetitions on a
steady host (0.762 .. 0.785, with turns of 50 to 500 ms alike), and the medians of two bench runs
agreed within 0.02. What turns cannot take away: while the host runs at two thirds of its speed, the
ratio itself is lower (hybrid 0.745 at 73 examples/s, 0.84-0.86 at 85-108), the harness' code losing
more to the neighbours than Hypothesis' does; such a repetition stays one sample of the median. Nor
the CPU model: the same code's np3 ratio read 0.77 on that host and 0.83-0.84 on an AMD EPYC, where
Hypothesis alone runs at half the speed and the harness' code at about the same (the bench records the
CPU and compares runs of one CPU only). A fresh, warmed interpreter per arm also takes away what the
bench's long-lived process had done before.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.statistics import collector

from harness.bench.baselines import PreconditionTape, TrivialMachine, empty_machine, recording
from harness.child import Spawned, read_lines, spawn
from harness.errors import EXIT_USAGE, HarnessError, Unavailable, UsageError
from properties.machine import MachineConfig, machine_class
from properties.run import machines_for, make_settings, run_seeded

__all__ = ["ARMS", "SLICE", "main", "run_arms", "split", "timed_arm"]

ARMS = ("machine", "replay", "trivial", "off")
SLICE = 0.05  # seconds each arm runs in its turn


def _cases(stats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every test case of a run, in order, from Hypothesis' statistics."""
    return [c for st in stats for ph, v in st.items() if ph.endswith("-phase") for c in v.get("test-cases", [])]


def split(stats: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds drawing (rule choice, preconditions, arguments) and in the bodies (rules, invariants, the
    stateful loop), and the test cases that do not count toward max_examples, from Hypothesis' statistics."""
    cases = _cases(stats)
    draw = sum(float(c["drawtime"]) for c in cases)
    return {
        "draw_s": round(draw, 3),
        "body_s": round(sum(float(c["runtime"]) for c in cases) - draw, 3),
        "gc_s": round(sum(float(c.get("gctime", 0.0)) for c in cases), 3),
        "invalid": sum(c["status"] == "invalid" for c in cases),
        "overrun": sum(c["status"] == "overrun" for c in cases),
    }


def _config(class_name: str) -> MachineConfig:
    configs = {c.class_name: c for c in machines_for("shared", "ci")}
    if class_name not in configs:
        raise UsageError(f"no gate machine {class_name!r}; the ci profile has {', '.join(configs)}")
    return configs[class_name]


def _arm_class(arm: str, cfg: MachineConfig, tape: PreconditionTape) -> type[RuleBasedStateMachine]:
    cls = machine_class(cfg)
    if arm == "machine":
        return cls
    if arm == "replay":
        return empty_machine(cls, f"{cfg.class_name}_programs", tape)
    if arm == "trivial":
        return TrivialMachine
    if arm == "off":
        return type(cfg.class_name, (cls,), {"checks_on": False, "__module__": __name__})
    raise UsageError(f"no arm {arm!r}; the arms are {', '.join(ARMS)}")


def _statuses(run: Callable[[], None]) -> list[str]:
    stats: list[dict[str, Any]] = []
    with cast(Any, collector).with_value(stats.append):
        run()
    return [c["status"] for c in _cases(stats)]


def timed_arm(
    arm: str, cfg: MachineConfig, examples: int, seed: int, *, ready: Callable[[], None] = lambda: None
) -> dict[str, Any]:
    """Record ``cfg``'s machine (untimed: the tape and the warm-up), call ``ready``, then time ``arm``.

    The machine and the replay must run exactly the recording's test cases (else the ratio would
    compare other programs): a machine run of other statuses, or a replay that did not read its tape
    to the end, raises :class:`UsageError`."""
    settings = make_settings("ci", None, examples)
    tape = PreconditionTape()
    try:
        recorded = _statuses(lambda: run_seeded(recording(machine_class(cfg), tape), settings, seed))
    except Exception as e:
        raise UsageError(f"{cfg.class_name} failed on seed {seed}: {e}") from e
    cls = _arm_class(arm, cfg, tape)
    ready()
    stats: list[dict[str, Any]] = []
    with cast(Any, collector).with_value(stats.append):
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            run_seeded(cls, settings, seed)
        except Exception as e:  # the replay: Hypothesis' "Inconsistent data generation" if the tape ran out of step
            if arm == "replay":
                tape.finish()
            raise UsageError(f"the {arm} arm of {cfg.class_name} failed on seed {seed}: {e}") from e
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    if arm == "replay":
        tape.finish()  # the replay drew exactly the machine's choices
    if arm == "machine" and [c["status"] for c in _cases(stats)] != recorded:
        raise UsageError(f"{cfg.class_name} ran other test cases than its recording on seed {seed}")
    # Hypothesis times its test cases by the wall clock, which runs on while the arm waits for its turn:
    # the seconds of the split are scaled to this run's CPU (its turns are spread evenly over the run)
    parts = split(stats)
    scale = cpu / wall if wall > 0 else 1.0
    for k in ("draw_s", "body_s", "gc_s"):
        parts[k] = round(parts[k] * scale, 3)
    return {"arm": arm, "cpu": cpu, "wall": wall, "split": parts, "calls": len(tape.calls)}


def _stop_self() -> None:
    print("ready", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # resumed by run_arms, in turns


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] == "T"


def run_arms(
    class_name: str, examples: int, seed: int, *, slice_s: float = SLICE, timeout: float = 1800.0
) -> dict[str, dict[str, Any]]:
    """Every arm of one repetition (:data:`ARMS`), each in a child, timed in turns on one CPU.

    Children are killed (with their process groups) however this returns: a result, an error, a
    timeout or Ctrl-C. A child that fails is one :class:`UsageError` line naming the arm."""
    _config(class_name)  # a bad name is a usage error here, not four failed children
    if not hasattr(os, "sched_setaffinity") or not Path("/proc/self/stat").exists():
        raise Unavailable("the exploration arms take turns through /proc and CPU affinity: Linux only")
    deadline = time.monotonic() + timeout
    children: dict[str, Spawned] = {}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="arms-") as tmp:
        try:
            for arm in ARMS:
                argv = [sys.executable, "-m", "harness.bench.arms", arm, class_name, str(examples), str(seed)]
                children[arm] = spawn(argv, stderr_path=os.path.join(tmp, f"{arm}.err"))
            ready: set[str] = set()
            while len(ready) < len(ARMS):  # every arm recorded, warmed and stopped itself
                for child, line in read_lines(list(children.values()), 0.2):
                    if line.strip() == "ready":
                        ready.add(next(a for a, c in children.items() if c is child))
                _check(children, results, deadline, tmp)
            while not all(_stopped(children[a].pid) for a in ARMS):
                _check(children, results, deadline, tmp)
                time.sleep(0.01)
            cpu = {max(os.sched_getaffinity(0))}
            for c in children.values():
                os.sched_setaffinity(c.pid, cpu)
            while len(results) < len(ARMS):
                for arm in [a for a in ARMS if a not in results]:
                    child = children[arm]
                    os.kill(child.pid, signal.SIGCONT)
                    end = time.monotonic() + slice_s
                    while arm not in results and (left := end - time.monotonic()) > 0:
                        for _, line in read_lines([child], left):
                            if line.startswith("{"):
                                results[arm] = json.loads(line)
                        _check(children, results, deadline, tmp)
                    if arm not in results:
                        os.kill(child.pid, signal.SIGSTOP)
        finally:
            for c in children.values():
                c.kill()
    return results


def _check(children: dict[str, Spawned], results: dict[str, Any], deadline: float, tmp: str) -> None:
    """Raise if a child exited without its result, or the repetition ran past its deadline."""
    for arm, c in children.items():
        if arm not in results and c.proc.poll() is not None and c.eof:
            tail = Path(tmp, f"{arm}.err").read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise UsageError(f"the {arm} arm exited with status {c.proc.returncode} before its result: {tail[0]}")
    if time.monotonic() > deadline:
        raise UsageError("an exploration repetition ran past its timeout; its arms were killed")


def main(argv: Sequence[str]) -> int:
    if len(argv) != 4 or argv[0] not in ARMS or not argv[2].isdigit() or not argv[3].isdigit():
        print(f"usage: python -m harness.bench.arms {{{','.join(ARMS)}}} CLASS EXAMPLES SEED", file=sys.stderr)
        return EXIT_USAGE
    try:
        r = timed_arm(argv[0], _config(argv[1]), int(argv[2]), int(argv[3]), ready=_stop_self)
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
