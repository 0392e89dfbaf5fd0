"""Running one state machine: the settings profiles, the seed, the shrunk program of a failure.

Everything that runs a Hypothesis machine goes through :func:`run_seeded`, which seeds Hypothesis
through its public API (``hypothesis.seed`` on the test of
``hypothesis.stateful.get_state_machine_test``): a seed gives the same examples on a developer's
machine and in CI (Hypothesis' own ``ci`` profile, chosen when ``CI`` is set, derandomizes, so the
profiles below set ``derandomize=False`` explicitly). The two gate profiles are registered once,
here, as Hypothesis settings profiles ``harness-ci`` and ``harness-fuzz``.

:func:`run_machine` turns a run into a :class:`MachineResult`; a failure carries the shrunk program
(ready to paste into ``python`` from the repository root), its number of steps and the replay line.

May import: ``harness.model``, ``harness.targets``, ``harness.errors``, ``properties``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.core import decode_failure
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    InMemoryExampleDatabase,
    choices_to_bytes,
)
from hypothesis.errors import InvalidArgument
from hypothesis.internal.conjecture import engine as _engine
from hypothesis.internal.conjecture import providers as _providers
from hypothesis.stateful import RULE_MARKER, RuleBasedStateMachine, get_state_machine_test

from harness.errors import PropertyFailure, UsageError
from properties.machine import MachineConfig, TargetCrash, machine_class
from properties.teardown import teardown_errors

__all__ = ["PROFILES", "SHRINKS", "Failure", "MachineResult", "commit",
           "machines_for", "make_settings", "program_of", "run_machine", "run_seeded"]  # fmt: skip

PROFILES: dict[str, dict[str, int]] = {
    "ci": {"max_examples": 300, "steps": 30},
    "fuzz": {"max_examples": 1500, "steps": 60},
}

for _name, _p in PROFILES.items():
    settings.register_profile(
        f"harness-{_name}",
        max_examples=_p["max_examples"],
        stateful_step_count=_p["steps"],
        deadline=None,
        database=None,
        report_multiple_bugs=False,
        derandomize=False,  # Hypothesis' own "ci" profile (CI=true) derandomizes; the seed must rule
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        print_blob=False,
    )


def make_settings(profile: str, db: str | None, max_examples: int | None = None) -> settings:
    """The registered profile, with the example database of the fuzz profile and an example budget."""
    base = settings.get_profile(f"harness-{profile}")
    if profile != "fuzz":
        return settings(base, max_examples=max_examples or base.max_examples)
    path = db or os.path.join(".hypothesis", "gate")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".probe")
        with open(probe, "w") as f:
            f.write("")
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"example database {path!r} is not usable: {e.strerror or e}") from None
    return settings(
        base,
        max_examples=max_examples or base.max_examples,
        database=DirectoryBasedExampleDatabase(path),
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    )


def _seeded_test(factory: Callable[[], RuleBasedStateMachine], cfg_settings: settings, seed_value: int) -> Any:
    test: Any = get_state_machine_test(factory, settings=cfg_settings)  # type: ignore[no-untyped-call]
    seed(seed_value)(test)
    return test


def _with_database(test: Any, db: ExampleDatabase) -> bool:
    """Put the example database back on a seeded test; False when this Hypothesis does not allow it.

    ``hypothesis.seed`` turns the database off (hypothesis/core.py ``seed``: the settings it leaves on
    the test get ``database=None``); the two runs of :func:`run_seeded` pass the failing example
    through it, so it goes back on the same settings object ``seed`` wrote.
    """
    current = getattr(test, "_hypothesis_internal_use_settings", None)
    if not isinstance(current, settings):
        return False
    test._hypothesis_internal_use_settings = settings(current, database=db)
    return True


def _rule_steps(factory: Callable[[], RuleBasedStateMachine], notes: Iterable[str]) -> int:
    """The rule calls in a failing example's printed program (its invariant checks are not steps)."""
    n = 0
    for line in notes:
        call = line.split(" = ", 1)[-1]  # a rule with a bundle target prints "x = state.rule(...)"
        if call.startswith("state.") and "(" in call:
            name = call[len("state.") : call.index("(")]
            n += getattr(getattr(factory, name, None), RULE_MARKER, None) is not None
    return n


_BLOB = re.compile(r"@reproduce_failure\('[^']*', (b'[A-Za-z0-9+/=]*')\)")


class _Handoff(InMemoryExampleDatabase):
    """The first run's failing example, offered to the second run as the secondary corpus of its key.

    Secondary, because an example found in the primary corpus counts as shrunk already
    (hypothesis/internal/conjecture/engine.py ``_run``: reused_previously_shrunk_test_case). Offered
    until the engine deletes it; what the shrinker saves is kept as in memory.
    """

    def __init__(self, choices: bytes) -> None:
        super().__init__()
        self.choices: bytes | None = choices

    def fetch(self, key: bytes) -> Iterable[bytes]:
        yield from super().fetch(key)
        if key.endswith(b".secondary") and self.choices is not None:
            yield self.choices

    def delete(self, key: bytes, value: bytes) -> None:
        if value == self.choices:
            self.choices = None
        super().delete(key, value)


def _failing_choices(exc: BaseException) -> bytes | None:
    """The failing example's choices, from the ``@reproduce_failure`` note (``print_blob``), which
    is taken off the exception; None when there is none."""
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        return None
    found = None
    for note in list(notes):
        m = _BLOB.search(note)
        if m:
            notes.remove(note)
            try:
                found = choices_to_bytes(decode_failure(ast.literal_eval(m.group(1))))
            except (ValueError, SyntaxError, InvalidArgument):
                found = None
    return found


@contextmanager
def _pinned_constants() -> Iterator[None]:
    """Generate without the constants Hypothesis collects from the local modules imported so far.

    Hypothesis sometimes draws a literal found in the user's own imported modules
    (hypothesis/internal/conjecture/providers.py ``_get_local_constants``: every module of
    ``sys.modules`` outside site-packages and the standard library). So the examples of a seed
    depended on what the entry point had imported: ``load-first-usable`` died on seed 0 of its own
    machine in 3.9 s under ``harness mutants`` and on the fifth machine after 35 s once the bench's
    modules were imported too. Pinned to none, a seed gives the same examples from every entry point
    (the gate, pytest, the bench, a replay line). A Hypothesis without that function is left as it is.
    """
    prov: Any = _providers  # internals: looked up, not typed
    get = getattr(prov, "_get_local_constants", None)
    cache: Any = getattr(getattr(prov, "CONSTANTS_CACHE", None), "cache", None)
    if get is None or not hasattr(cache, "clear") or not hasattr(prov, "Constants"):
        yield
        return
    none = prov.Constants()
    prov._get_local_constants = lambda: none
    cache.clear()  # permitted constants cached with the local ones
    try:
        yield
    finally:
        prov._get_local_constants = get
        cache.clear()


# How many times Hypothesis' shrinker may shrink a synthetic machine's failure (a smaller failing example
# found) before :func:`tidy` deletes the steps it does not need. A count, not a time, so the program
# and the failure reported for a seed do not depend on the machine's speed. Bench mutants, 23 mutants:
# with Hypothesis' own 500 the shrink was 11 of a median kill's 12.5 s; with 15 the median kill is
# 1.2 s and the median program 4 steps (max 9). The fuzz profile keeps Hypothesis' own limit.
SHRINKS: dict[str, int | None] = {"ci": 15, "fuzz": None}


@contextmanager
def _shrink_limit(shrinks: int | None) -> Iterator[None]:
    """Stop Hypothesis' shrinker after ``shrinks`` shrinks (hypothesis/internal/conjecture/engine.py
    ``MAX_SHRINKS``, 500 there, read after each one); None leaves Hypothesis' own limit. It reports the
    smallest failing example found by then."""
    eng: Any = _engine
    old = getattr(eng, "MAX_SHRINKS", None)
    if shrinks is None or not isinstance(old, int):
        yield
        return
    eng.MAX_SHRINKS = shrinks
    try:
        yield
    finally:
        eng.MAX_SHRINKS = old


def run_seeded(
    factory: Callable[[], RuleBasedStateMachine],
    cfg_settings: settings,
    seed_value: int,
    *,
    shrinks: int | None = None,
) -> None:
    with _pinned_constants():
        _run_seeded(factory, cfg_settings, seed_value, shrinks)


def _run_seeded(
    factory: Callable[[], RuleBasedStateMachine], cfg_settings: settings, seed_value: int, shrinks: int | None
) -> None:
    """Run a state machine as a test under ``cfg_settings``, its randomness derived from ``seed_value``
    alone (:func:`_pinned_constants`).

    The example database of ``cfg_settings`` (the fuzz profile's ``.hypothesis/gate`` or ``--db``) is
    used: its failures are replayed first and a new one is saved there. (``hypothesis.seed`` turns a
    test's database off; :func:`_with_database` puts it back.) Without one, the run has none: a
    database changes what a seed generates (Hypothesis keeps a pareto front beside it, which draws
    from the same random source).

    A failure is shrunk in a second run, on a step count cut to the failing program's steps. The first
    run leaves out Hypothesis' shrink phase and prints the failing example's choices
    (``print_blob``); the second is handed them (:class:`_Handoff`), replays them (the reuse phase)
    and shrinks them with ``stateful_step_count`` = the steps the example failed at. Replayed with
    that count, the example draws the same choices up to its failure, so it fails the same way.
    Hypothesis runs a machine to its step count on every example that does not fail, and most of
    what the shrinker tries does not fail: with the profile's count (30), a failure at step 3 made
    each such try 30 steps long (bench ``mutants``: the shrink phase was 13 of a kill's 14 seconds).
    A failure the second run does not reproduce is raised as the first run found it, unshrunk.
    """
    user = cfg_settings.database
    find = settings(
        cfg_settings, phases=[p for p in cfg_settings.phases if p is not Phase.shrink], print_blob=True
    )
    test = _seeded_test(factory, find, seed_value)
    if Phase.shrink not in cfg_settings.phases or (user is not None and not _with_database(test, user)):
        whole = _seeded_test(factory, cfg_settings, seed_value)
        if user is not None:
            _with_database(whole, user)
        whole()  # one run, Hypothesis' own shrink (if its phases have it)
        return
    try:
        test()
    except Exception as found:
        choices = _failing_choices(found)
        if choices is None:
            raise
        steps = _rule_steps(factory, getattr(found, "__notes__", []))
        handoff = _Handoff(choices)
        shrink = settings(cfg_settings, phases=[Phase.reuse, Phase.shrink], stateful_step_count=max(1, steps))
        again = _seeded_test(factory, shrink, seed_value)
        if not _with_database(again, handoff):
            raise
        try:
            with _shrink_limit(shrinks):
                again()
        except Exception as shrunk:
            raise shrunk from None
        finally:
            if user is not None:  # the shrunk example replaces the found one there
                for key, values in list(handoff.data.items()):
                    for value in values:
                        user.save(key, value)
                    if values and not key.endswith(b".secondary"):
                        user.delete(key, choices)
        raise found from None


def machines_for(semantics: str, profile: str) -> list[MachineConfig]:
    """The machine configurations one gate run covers."""
    base = [
        MachineConfig(semantics, "hybrid"),
        MachineConfig(semantics, "hybrid", draft=True),
        MachineConfig(semantics, "recurrent", kv_unified=True),
        MachineConfig(semantics, "iswa"),
        MachineConfig(semantics, "transformer", draft=True, kv_unified=True),
        # policy reachability: no byte limit (the token limit n_ctx = 44 evicts) and little KV room
        # (cache loads fail for lack of cells)
        MachineConfig(semantics, "transformer", kv_unified=True, cache_ram=-1, n_ctx=44),
        MachineConfig(semantics, "hybrid", kv_unified=True, n_slots=3, cache_ram=-1, n_ctx=44),
    ]
    if profile == "fuzz":
        base += [
            MachineConfig(semantics, kind, draft=d, kv_unified=k, n_slots=n)
            for kind in ("transformer", "recurrent", "hybrid", "iswa")
            for d in (False, True)
            for k in (False, True)
            for n in (2, 3)
            if MachineConfig(semantics, kind, draft=d, kv_unified=k, n_slots=n) not in base
        ]
    return base


@dataclass
class Failure:
    property: str
    kind: str  # "violation" | "crash" | "error"
    message: str
    program: str
    replay: str
    machine: str
    steps: int
    teardown: list[str] = field(default_factory=list)  # what teardown then raised, beside the failure


@dataclass
class MachineResult:
    config: MachineConfig
    seconds: float
    failure: Failure | None
    checked: Counter[str]
    check_seconds: Counter[str]
    peaks: list[tuple[int, int, int]]


def commit() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    sha = out.stdout.strip() or "unknown"
    return sha + ("+dirty" if dirty.stdout.strip() else "")


def _program(cfg: MachineConfig, notes: Iterable[str]) -> tuple[str, int]:
    lines = [n for n in notes if n.startswith("state")]
    head = ["from properties.machine import MachineConfig, machine_class"]
    config = repr(cfg)  # resolve is not part of the repr
    mods = ["properties.families"] if cfg.family else []  # it registers the families (properties.machine.FAMILIES)
    if cfg.resolve is not None:
        mods.append(cfg.resolve.__module__)  # properties.mutants or properties.families
        config = config[:-1] + f", resolve={cfg.resolve.__module__}.{cfg.resolve.__name__})"
    head = [f"import {m}" for m in dict.fromkeys(mods)] + head
    head.append(f"{cfg.class_name} = machine_class({config})")
    return "\n".join(head + lines), _count_steps("\n".join(lines))


program_of = _program  # the shrunk program of a machine's failure from its notes, and its number of steps

TIDY_SECONDS = 20.0  # the budget of :func:`tidy` per failure


def _failure_of(program: str) -> PropertyFailure | None:
    """Run a printed program as pasted; the property failure it raises, if any."""
    try:
        exec(compile(program, "<program>", "exec"), {})  # our own printed program, as a user pastes it
    except PropertyFailure as e:
        return e
    except Exception:
        return None  # another error: not the same failure
    return None


def _overlaps(line: str) -> bool:
    return line.startswith("state.request(") and "overlap=True" in line


def tidy(program: str, name: str, crash: bool, budget: float = TIDY_SECONDS) -> str:
    """The shrunk program without the steps its failure does not need: a last pass after Hypothesis.

    Hypothesis' shrinker works on the choice sequence, where a step that changes nothing (a
    ``set_limit`` to the limit already set) is cheap to keep and its simplest form: repeated
    ``set_limit(cache_ram=1)`` lines survived it. Here each step (its line and the invariant check
    after it) is deleted in turn, last first, then each two neighbouring steps (a request and the
    ``finish`` that completes it go together), then each ``request(overlap=True)`` followed by
    ``finish()`` becomes one ``request(overlap=False)``, the same server work in one step (only the
    invariant check between the two goes). A change is kept when the program still fails on
    property ``name`` the same way (a crash stays a crash); passes repeat until none changes a step
    or ``budget`` seconds are spent. A synthetic machine's program runs in milliseconds; one on
    libllama makes its contexts again each time (freed with the machine), which the budget bounds."""
    lines = program.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("state = ")) + 1
    except StopIteration:
        return program
    if start < len(lines) and lines[start] == "state.state_invariants()":
        start += 1
    head, body = lines[:start], lines[start:]
    steps: list[list[str]] = []  # each step's line and the checks after it
    tail: list[str] = []
    for line in body:
        if line.startswith("state.teardown"):
            tail.append(line)
        elif line.startswith("state.state_invariants") and steps:
            steps[-1].append(line)
        else:
            steps.append([line])

    def same(candidate: list[list[str]]) -> bool:
        e = _failure_of("\n".join(head + [x for st in candidate for x in st] + tail))
        return e is not None and e.name == name and isinstance(e, TargetCrash) == crash

    deadline = time.perf_counter() + budget
    changed = True
    while changed and time.perf_counter() < deadline:
        changed = False
        for width in (1, 2):  # a step, then two neighbours (a request and the finish it needs)
            for i in range(len(steps) - width, -1, -1):
                if time.perf_counter() >= deadline:
                    break
                if i + width <= len(steps) and same(steps[:i] + steps[i + width :]):
                    del steps[i : i + width]
                    changed = True
        for i in range(len(steps) - 2, -1, -1):  # a request and the finish right after it: one step
            if time.perf_counter() >= deadline:
                break
            if i + 1 < len(steps) and _overlaps(steps[i][0]) and steps[i + 1][0] == "state.finish()":
                merged = [steps[i][0].replace("overlap=True", "overlap=False"), *steps[i][1:]]
                if same([*steps[:i], merged, *steps[i + 2 :]]):
                    steps[i : i + 2] = [merged]
                    changed = True
    return "\n".join(head + [x for st in steps for x in st] + tail)


def run_machine(
    cfg: MachineConfig, cfg_settings: settings, seed_value: int, replay: str, *, shrinks: int | None = None
) -> MachineResult:
    """Run the machine of ``cfg`` with ``seed_value``; a failure is caught and returned with its program.

    ``shrinks`` limits Hypothesis' shrinker on a synthetic machine (:data:`SHRINKS`); a machine on a
    real target shrinks as long as Hypothesis likes (``corrupt-checkpoint-restore``: a shrink cut
    short after 1 s left a program :func:`tidy` cut to 9 steps, a whole one 6). Then :func:`tidy`
    cuts the program of either. ``teardown`` is what the failing example's teardown raised after it
    (:mod:`properties.teardown`), kept beside the failure.
    """
    cls = machine_class(cfg)
    cls.stats_checked.clear()
    cls.stats_seconds.clear()
    cls.peaks.clear()
    cls.llama_stats.clear()
    cls.layout_example.clear()
    cls.finding_examples.clear()
    cls.reuse_counts.clear()
    cls.stats_branches.clear()
    t0 = time.perf_counter()
    failure: Failure | None = None
    try:
        run_seeded(cls, cfg_settings, seed_value, shrinks=None if cfg.arch else shrinks)
    except Exception as e:  # a property, or a bug of the harness or the model itself: still reproducible
        program, steps = _program(cfg, getattr(e, "__notes__", []))
        if isinstance(e, PropertyFailure):
            prop, kind, msg = e.name, "crash" if isinstance(e, TargetCrash) else "violation", e.message
        else:
            prop, kind, msg = "crash", "error", f"{type(e).__name__}: {e}"
        failure = Failure(prop, kind, msg, program, replay, cfg.class_name, steps, teardown_errors(e))
    result = MachineResult(
        cfg, time.perf_counter() - t0, failure, Counter(cls.stats_checked), Counter(cls.stats_seconds), list(cls.peaks)
    )
    if failure is not None and failure.kind != "error":
        failure.program = tidy(failure.program, failure.property, failure.kind == "crash")
        failure.steps = _count_steps(failure.program)
        printed = _failure_of(failure.program)
        if printed is not None:
            failure.message = printed.message  # the message of the program as printed
    return result


def _count_steps(program: str) -> int:
    return sum(
        1 for n in program.splitlines()
        if n.startswith("state.") and not n.startswith(("state.teardown", "state.state_inv"))
    )  # fmt: skip
