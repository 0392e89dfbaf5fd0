"""``python -m harness rlimit``: the seed's save under a real address-space limit, both semantics.

The seed's case: a slot of a hybrid model holds a checkpoint of C bytes and saves its prompt with a
new state of S bytes. The entry (S + C logical bytes) satisfies ``--cache-ram``, but ``master``
deep-copies the checkpoint while the slot still owns it, so the save needs S + C more bytes of
address space, while ``shared`` (PR #27451) needs S. Under ``RLIMIT_AS`` set just above what
``shared`` needs, ``shared`` completes and ``master`` fails.

How it runs, and what it promises:

* Every measurement is made in a child (``python -m faults.rlimit --child``) that builds the
  server, then **forks** (:func:`harness.child.run_child` with a function): the forked process
  starts with ``VmPeak`` equal to its current size, sets the limit on itself only, saves, and
  reports ``VmPeak``. The runner is never limited.
* The budget is measured, not guessed: a first pass saves without a limit in both semantics and
  reads each save's peak above the baseline; the budget is ``shared``'s peak plus a quarter of
  the gap to ``master``'s. It is printed and written with ``--json`` as ``budget_bytes`` (headroom
  above the baseline at the save), with both outcomes.
* A real ``ENOMEM`` inside a modelled allocation becomes the model's ``BadAlloc`` at that site
  (the Python ``MemoryError`` is translated at the seam), so each semantics' own handler decides the
  :class:`faults.kinds.Outcome`: ``ok`` (the save completed), ``accepted-error`` (caught by ``alloc``:
  the save returned False), ``crash`` (the ``bad_alloc`` escaped: upstream terminates),
  ``crash-out-of-scope`` (the failure hit the interpreter outside a modelled allocation), or
  ``aborted``/``killed`` (the saving process died).

Two properties of the Python model shape the scenario, and are deliberate:

* The synthetic provider builds state bytes in a Python buffer before the model copies them in;
  libllama writes straight into the destination. :class:`ServedProvider` serves the bytes it
  already holds, so the save's footprint is the model's buffers only.
* The model's deep copy allocates a zeroed buffer of the checkpoint's size, then adopts the source's
  immutable bytes object (``Payload.fill``), so only one copied checkpoint is resident at a time in
  Python. The scenario keeps one checkpoint (``--ctx-checkpoints 1``) so that C is exactly what the
  copy needs, as in C++.

:func:`run_limited` is the same mechanism for any callable: ``run_limited(fn, *args, headroom=N)``
forks, limits the forked process's address space to its size at the fork plus ``headroom`` bytes
(or to ``limit`` bytes), calls ``fn`` there and brings back a :class:`LimitedRun`: the returned
value (pickled), a ``MemoryError``, another exception, or the signal that killed it, and its VmPeak.

Exit: 0 when ``shared`` completes and ``master`` does not; 1 when that does not hold; 2 when the
environment cannot separate the two (no fork, no ``/proc``); 3 when a child died unexpectedly.
"""

from __future__ import annotations

import gc
import json
import math
import os
import pickle
import resource
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from faults.kinds import Outcome, died
from faults.scenarios import prompt
from harness.child import child_setup, run_child
from harness.errors import EXIT_CRASH, EXIT_FAILED, EXIT_OK, EXIT_USAGE, BadAlloc, UsageError
from harness.model.memory import Host, Payload
from harness.model.provider import STATE_SEQ_FLAGS_NONE, MemoryKind, SyntheticProvider
from harness.model.semantics import get_semantics
from harness.model.server_context import ServerContext, ServerParams

__all__ = ["LimitedRun", "RlimitResult", "ServedProvider", "measure", "run_limited", "run_seed"]

MiB = 1024 * 1024
_ROOT = str(Path(__file__).resolve().parent.parent)


class ServedProvider(SyntheticProvider):
    """A synthetic provider that serves the last state bytes it built for the same sequence state."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._served: dict[tuple[int, int], tuple[object, bytes]] = {}

    def state_seq_get_data_ext(self, seq: int, flags: int) -> bytes:
        key = tuple((c.cid, c.hist, c.lo) for c in self._selected(seq, flags))
        hit = self._served.get((seq, flags))
        if hit is not None and hit[0] == key:
            return hit[1]
        self._served.pop((seq, flags), None)  # drop the old bytes before building new ones
        data = super().state_seq_get_data_ext(seq, flags)
        self._served[(seq, flags)] = (key, data)
        return data


@dataclass
class RlimitResult:
    semantics: str
    outcome: Outcome
    peak_bytes: int  # VmPeak of the saving process
    baseline_bytes: int  # its VmSize when the save began
    limit_bytes: int | None  # RLIMIT_AS it ran under (None: unlimited probe)
    state_bytes: int  # S
    checkpoint_bytes: int  # C
    cache_ram_bytes: int  # --cache-ram of the scenario
    detail: str

    @property
    def peak_excess(self) -> int:
        return self.peak_bytes - self.baseline_bytes


# ---- child side ---------------------------------------------------------------------------------


def _vm() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmPeak:", "VmSize:", "VmData:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    return out


def _build(semantics: str, rs_bytes: int) -> tuple[ServerContext, int, int, int]:
    """The seed's server, its prompt processed: (server, S, C, cache_ram_bytes)."""
    tgt = ServedProvider(MemoryKind.HYBRID, name="tgt", n_seq=1, n_ctx=256, kv_bytes_per_token=64, rs_bytes=rs_bytes)
    # the entry S + C fits --cache-ram with a MiB to spare: the limit is not what stops master
    cache_ram_mib = math.ceil(2 * (rs_bytes + 64 * 64) / MiB) + 1
    params = ServerParams(
        n_slots=1, cache_ram=cache_ram_mib, cache_ram_unit=MiB, cache_idle_slots=False, n_ctx_checkpoints=1
    )
    server = ServerContext(params, Host(), get_semantics(semantics), tgt, None)
    server.handle_completion(prompt(24, 1), n_predict=1)
    server.run_until_idle()
    slot = server.slots[0]
    s = tgt.state_seq_get_size_ext(slot.id, STATE_SEQ_FLAGS_NONE)
    c = sum(ck.size() for ck in slot.prompt.checkpoints)
    tgt.state_seq_get_data_ext(slot.id, STATE_SEQ_FLAGS_NONE)  # what the save will be served
    return server, s, c, cache_ram_mib * MiB


def _real_oom_is_bad_alloc(host: Host) -> None:
    """Translate a real ``MemoryError`` in a modelled allocation into ``BadAlloc`` at that site."""
    inner = host.alloc_payload

    def alloc_payload(site: str, nbytes: int, kind: str) -> Payload | None:
        try:
            return inner(site, nbytes, kind)
        except BadAlloc:
            raise
        except MemoryError:
            raise BadAlloc(site, host.seam.count, nbytes) from None

    setattr(host, "alloc_payload", alloc_payload)  # noqa: B010 - instance attribute, like the Tracer


def _save_under_limit(server: ServerContext, headroom: int | None) -> dict[str, Any]:
    """In the forked process: limit, save, classify, measure."""
    vm = _vm()
    limit = None
    if headroom is not None:
        limit = vm["VmSize"] + headroom
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    _real_oom_is_bad_alloc(server.host)
    slot = server.slots[0]
    cache = server.prompt_cache
    assert cache is not None
    try:
        ok = slot.prompt_save(cache)
        outcome, detail = (
            (Outcome.OK, "completed: the entry is cached")
            if ok
            else (
                Outcome.ACCEPTED,
                "handled: " + "; ".join(cache.log[-2:]),
            )
        )
    except BadAlloc as e:
        outcome, detail = Outcome.CRASH, f"{e} escaped prompt_save: upstream terminates"
    except MemoryError:
        outcome, detail = Outcome.CRASH_OUT_OF_SCOPE, "MemoryError outside a modelled allocation"
    return {"outcome": outcome, "detail": detail, "peak": _vm()["VmPeak"], "baseline": vm["VmSize"], "limit": limit}


def _child_main(spec_text: str) -> int:
    # no watchdog thread: a second thread gets a glibc arena whose reserved address space would
    # silently absorb an allocation that the limit refuses in the main arena (the runner's timeout
    # and the process group kill still apply)
    child_setup(watchdog=False)
    spec = json.loads(spec_text)
    server, s, c, cram = _build(spec["semantics"], spec["rs_bytes"])
    gc.collect()

    def save() -> None:  # the saving process: forked, so its VmPeak starts at the size of this one
        print(json.dumps(_save_under_limit(server, spec["headroom"])))

    saved = run_child(save, timeout=spec["timeout"])
    text = saved.stdout.strip()
    res: dict[str, Any]
    if saved.crashed or not text:
        res = {
            "outcome": died(saved),
            "detail": f"the saving process {saved.describe()} without a result: {saved.stderr.strip()[-200:]}",
            "peak": 0,
            "baseline": 0,
            "limit": None,
        }
    else:
        res = json.loads(text)
    sem = spec["semantics"]
    out = RlimitResult(
        sem, Outcome(res["outcome"]), res["peak"], res["baseline"], res["limit"], s, c, cram, res["detail"]
    )
    print(json.dumps(asdict(out)), flush=True)
    return 0


# ---- runner side --------------------------------------------------------------------------------


def measure(semantics: str, *, headroom: int | None, rs_bytes: int, timeout: float = 120.0) -> RlimitResult:
    """One child: build the seed's server for ``semantics``, fork, save with ``headroom`` (None: no limit)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    env["MALLOC_ARENA_MAX"] = "1"  # one glibc arena: no reserved arena space to fall back on
    spec = {"semantics": semantics, "headroom": headroom, "rs_bytes": rs_bytes, "timeout": timeout * 0.8}
    child = run_child([sys.executable, "-m", "faults.rlimit", "--child", json.dumps(spec)], env=env, timeout=timeout)
    line = next((ln for ln in child.stdout.splitlines() if ln.startswith("{")), None)
    if child.crashed or line is None:
        why = f"child {child.describe()}: {child.stderr.strip()[-300:]}"
        if child.stacks:
            why += f"\n{child.stacks.strip()}"
        return RlimitResult(semantics, died(child), 0, 0, None, 0, 0, 0, why)
    row = json.loads(line)
    return RlimitResult(**{**row, "outcome": Outcome(row["outcome"])})


# ---- any callable under a limit ------------------------------------------------------------------


@dataclass
class LimitedRun:
    """How :func:`run_limited`'s call ended, in the fault layers' one vocabulary (:class:`Outcome`).

    ``ok`` (it returned; ``value`` holds what), ``accepted-error`` (it raised ``MemoryError``: the
    limit was met the way Python reports it), ``crash-out-of-scope`` (another exception; ``error``
    names it), ``killed`` (a signal or the timeout; ``error`` says which) or ``aborted`` (SIGABRT).
    """

    outcome: Outcome
    value: Any
    error: str
    peak_bytes: int  # VmPeak of the forked process (0 when it died before reporting)
    baseline_bytes: int  # its VmSize at the fork
    limit_bytes: int | None  # the RLIMIT_AS it ran under (None: no limit)

    @property
    def ok(self) -> bool:
        return self.outcome == Outcome.OK


def _limited_child(
    result_path: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    headroom: int | None,
    limit: int | None,
) -> int:
    """In the forked process: limit, call, write the pickled result to ``result_path``."""
    vm = _vm()
    if headroom is not None:
        limit = vm["VmSize"] + headroom
    if limit is not None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    try:
        row: tuple[Outcome, Any, str] = (Outcome.OK, fn(*args, **kwargs), "")
    except MemoryError as e:
        row = (Outcome.ACCEPTED, None, f"MemoryError: {e}")
    except BaseException as e:
        row = (Outcome.CRASH_OUT_OF_SCOPE, None, f"{type(e).__name__}: {e}")
    peak = _vm()["VmPeak"]
    try:
        data = pickle.dumps((*row, peak, vm["VmSize"], limit))
    except MemoryError:
        data = pickle.dumps((Outcome.ACCEPTED, None, "MemoryError pickling the result", peak, vm["VmSize"], limit))
    except Exception as e:
        data = pickle.dumps(
            (Outcome.CRASH_OUT_OF_SCOPE, None, f"the result cannot be pickled: {e}", peak, vm["VmSize"], limit)
        )
    with open(result_path, "wb") as f:
        f.write(data)
    return 0


def run_limited(
    fn: Callable[..., Any],
    /,
    *args: Any,
    headroom: int | None = None,
    limit: int | None = None,
    timeout: float = 60.0,
    **kwargs: Any,
) -> LimitedRun:
    """Call ``fn(*args, **kwargs)`` in a forked child (:func:`harness.child.run_child`) under
    ``RLIMIT_AS``; the caller is never limited.

    ``headroom``: bytes of address space above the forked process's size at the fork; ``limit``:
    an absolute limit; neither: no limit (a probe, for ``peak_bytes``). ``fn`` need not be
    picklable (the process is forked); its result must be. Linux only (``fork``, ``/proc``).
    """
    if headroom is not None and limit is not None:
        raise ValueError("give headroom or limit, not both")
    if not hasattr(os, "fork") or not os.path.exists("/proc/self/status"):
        raise UsageError("run_limited needs fork() and /proc/self/status (Linux)")
    with tempfile.TemporaryDirectory(prefix="run-limited-") as tmp:
        result_path = os.path.join(tmp, "result.pickle")
        child = run_child(lambda: _limited_child(result_path, fn, args, kwargs, headroom, limit), timeout=timeout)
        if child.status == "exited" and os.path.exists(result_path):
            with open(result_path, "rb") as f:
                outcome, value, error, peak, baseline, lim = pickle.load(f)
            return LimitedRun(outcome, value, error, peak, baseline, lim)
    if child.status == "exited":
        return LimitedRun(Outcome.KILLED, None, f"{child.describe()} without a result: {child.stderr[-300:]}", 0, 0,
                          limit)  # fmt: skip
    return LimitedRun(died(child), None, child.describe(), 0, 0, limit)


@dataclass
class SeedRun:
    budget_bytes: int
    probes: list[RlimitResult]
    results: list[RlimitResult]

    def exit_code(self) -> int:
        by = {r.semantics: r for r in self.results}
        dead = (Outcome.ABORTED, Outcome.KILLED)
        if any(r.outcome in dead for r in self.probes) or by["shared"].outcome in dead:
            return EXIT_CRASH
        ok = by["shared"].outcome == Outcome.OK and by["master"].outcome != Outcome.OK
        return EXIT_OK if ok else EXIT_FAILED

    def to_json(self) -> dict[str, object]:
        return {
            "budget_bytes": self.budget_bytes,
            "results": [_row(r) for r in self.results],
            "probes": [_row(r) for r in self.probes],
        }


def _row(r: RlimitResult) -> dict[str, object]:
    """A result in the JSON: the key ``variant`` stays beside ``semantics`` for one release (docs/mechanism.md)."""
    return {**asdict(r), "variant": r.semantics, "peak_excess_bytes": r.peak_excess}


def run_seed(rs_mib: int = 40, timeout: float = 120.0) -> SeedRun:
    """Probe both semantics without a limit, derive the budget, run both under it."""
    if not hasattr(os, "fork") or not os.path.exists("/proc/self/status"):
        raise UsageError("the rlimit layer needs fork() and /proc/self/status (Linux)")
    rs = rs_mib * MiB
    probes = [measure(v, headroom=None, rs_bytes=rs, timeout=timeout) for v in ("shared", "master")]
    if any(p.outcome != Outcome.OK for p in probes):
        bad = next(p for p in probes if p.outcome != Outcome.OK)
        return SeedRun(0, probes, [bad, *(p for p in probes if p is not bad)])
    shared, master = probes
    gap = master.peak_excess - shared.peak_excess
    if gap < MiB:
        raise UsageError(
            f"cannot separate the semantics here: master's save peaks {gap} bytes above shared's (expected ~C)"
        )
    budget = shared.peak_excess + max(gap // 4, 256 * 1024)
    results = [measure(v, headroom=budget, rs_bytes=rs, timeout=timeout) for v in ("shared", "master")]
    return SeedRun(budget, probes, results)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        raise SystemExit(_child_main(sys.argv[2]))
    print("usage: python -m harness rlimit", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)
