"""Fault layers on llama-cpp-python's caches: CPython allocation failures and ``RLIMIT_AS``, in children.

Both layers judge ``fault_atomic`` (:func:`properties.lcp_machine.diagnose_fault`): after a failure
inside ``cache[key] = state`` the cache must hold exactly what it held before, or that plus the new
entry, complete, with the capacity enforced. Each trial is one :class:`faults.kinds.Outcome`
(``ok``: no failure reached the insert; ``accepted-error``: it failed and the cache is as allowed;
``violation``: it is not, the row's ``finding`` naming a known one; ``aborted``/``killed``: the
child died), and the row's ``state`` says what the cache holds (``unchanged``, ``inserted``,
``lost``, ``over-capacity``, ``inconsistent``).

``pymem`` (:func:`sweep_pymem`)
    ``_testcapi.set_nomemory`` fails CPython allocation ``1, 1+stride, ...`` of ``cache[key] = state``
    (``reinsert``: the middle of three entries again; ``evict``: a new entry that evicts), in a child
    (``python -m faults.lcp_cache --pymem-child``) under a watchdog; a dead child's point is a row of its
    own and the next child resumes after it.
``rlimit`` (:func:`run_rlimit`)
    A child (``python -m faults.lcp_cache --rlimit-child``) caches three ~1.2 MB states, then per headroom
    forks (:func:`harness.child.run_child` with a function), limits its own address space to its
    size plus the headroom, and re-inserts one entry.

Disk caches of both children live in a directory the runner makes and removes, even when a child dies.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import json
import os
import resource
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from faults.kinds import Outcome, died
from faults.pymem import pymem_unavailable
from fixtures.gguf import model_path
from harness.child import child_setup, run_child
from harness.targets.lcp_cache import ALPHABET, BOS, TMP, CacheAdapter, Key, ModelEnv, held_bytes, llama_cpp
from properties.lcp_machine import ALLOWED_STATES, diagnose_fault

__all__ = ["fault_outcome", "run_rlimit", "sweep_pymem"]

ROOT = Path(__file__).resolve().parents[1]


def _scenario(adapter: CacheAdapter, env: ModelEnv, act: str) -> tuple[Any, Key, Any, int]:
    """A cache holding three entries; ``act`` re-inserts the middle one (``reinsert``) or adds one that evicts."""
    keys: list[Key] = [(BOS, ALPHABET[0]), (BOS, ALPHABET[1], ALPHABET[1]), (BOS, ALPHABET[2], ALPHABET[0])]
    new: Key = keys[1] if act == "reinsert" else (BOS, ALPHABET[2], ALPHABET[2], ALPHABET[2])
    sizes = [adapter.entry_size(env.state(k)) for k in keys]
    base = adapter.base()
    cap = base + sum(sizes) + (adapter.entry_size(env.state(new)) // 2 if act == "evict" else 4096 * 4)
    cache = adapter.make(cap)
    with adapter.quiet():
        for k in keys:
            cache[k] = env.state(k)
    return cache, new, env.state(new), cap


def fault_outcome(cache_state: str, *, fired: bool) -> Outcome:
    """A trial's :class:`Outcome` from what the cache holds after it (:func:`diagnose_fault`'s state)."""
    if cache_state not in ALLOWED_STATES:
        return Outcome.VIOLATION
    return Outcome.ACCEPTED if fired else Outcome.OK


def _pymem_child(spec: dict[str, Any]) -> int:
    child_setup(watchdog=True)
    if pymem_unavailable() is not None:
        print(json.dumps({"unavailable": "no _testcapi.set_nomemory"}), flush=True)
        return 0
    capi = importlib.import_module("_testcapi")
    env = ModelEnv("llama")
    adapter = CacheAdapter(spec["cache"], tmp=spec["tmp"])  # the parent removes it, even when this child dies
    try:
        # what a successful insert leaves: the same act once without a fault
        cache, key, state, cap = _scenario(adapter, env, spec["act"])
        with adapter.quiet():
            cache[key] = state
        expected = adapter.keys(cache)
        adapter.close(cache)
        for nth in spec["points"]:
            cache, key, state, cap = _scenario(adapter, env, spec["act"])
            before = adapter.keys(cache)
            escaped: BaseException | None = None
            reached = True
            gc.collect()
            gc.disable()
            with adapter.quiet():
                capi.set_nomemory(nth - 1, nth)
                try:
                    try:
                        cache[key] = state
                    except BaseException as e:
                        escaped = e
                    if escaped is None:
                        try:
                            bytearray(64)
                        except MemoryError:
                            reached = False
                finally:
                    capi.remove_mem_hooks()
                    gc.enable()
            after = adapter.keys(cache)
            over = int(cache.cache_size) > cap
            cache_state, finding = diagnose_fault(before, after, key, expected, over)
            row = {
                "nth": nth,
                "reached": reached,
                "escaped": None if escaped is None else f"{type(escaped).__name__}: {escaped}"[:160],
                "outcome": fault_outcome(cache_state, fired=reached),
                "state": cache_state,
                "finding": finding,
                "before": [len(k) for k in before],
                "after": [len(k) for k in after],
            }
            adapter.close(cache)
            adapter.cleanup()
            print(json.dumps(row), flush=True)
            if not reached:
                break
    finally:
        adapter.cleanup()
    return 0


def sweep_pymem(
    cache: str, act: str, *, max_points: int, stride: int = 1, timeout: float = 60.0
) -> list[dict[str, Any]]:
    """Fail CPython allocation ``1, 1+stride, ...`` of ``cache[key] = state`` (transient), in a child."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    rows: list[dict[str, Any]] = []
    points = list(range(1, 1 + max_points * stride, stride))
    tmp = tempfile.mkdtemp(prefix="lcp-pymem-", dir=TMP)
    try:
        _sweep_points(cache, act, points, tmp, env, rows, timeout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _sweep_points(
    cache: str, act: str, points: list[int], tmp: str, env: dict[str, str], rows: list[dict[str, Any]], timeout: float
) -> None:

    while points:
        spec = {"cache": cache, "act": act, "points": points, "tmp": tmp}
        child = run_child(
            [sys.executable, "-m", "faults.lcp_cache", "--pymem-child", json.dumps(spec)],
            env=env,
            timeout=timeout,
        )
        got = [json.loads(ln) for ln in child.stdout.splitlines() if ln.startswith("{")]
        if got and "unavailable" in got[0]:
            return
        rows.extend({**r, "outcome": Outcome(r["outcome"])} for r in got)
        if (got and not got[-1]["reached"]) or len(got) >= len(points):
            break
        dead = points[len(got)]
        rows.append(
            {
                "nth": dead,
                "reached": True,
                "escaped": f"child {child.describe()}",
                "outcome": died(child),
                "state": None,
                "finding": None,
                "before": [],
                "after": [],
            }
        )
        points = points[len(got) + 1 :]


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _reinsert_under_limit(
    adapter: CacheAdapter, cache: Any, key: Key, new: Any, before: list[Key], expected: list[Key], headroom: int | None
) -> None:
    """In a forked process (its VmSize is its parent's): limit, re-insert ``key``, report one JSON row."""
    res: dict[str, Any] = {"headroom": headroom}
    if headroom is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + headroom, hard))
    try:
        with adapter.quiet():
            cache[key] = new
        res["escaped"] = None
    except MemoryError as e:
        res["escaped"] = f"MemoryError: {e}"[:160]
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    after = adapter.keys(cache)
    res["state"], res["finding"] = diagnose_fault(before, after, key, expected, False)
    res["outcome"] = fault_outcome(res["state"], fired=res["escaped"] is not None)
    res["state_bytes"] = held_bytes(new)
    print(json.dumps(res))


def _rlimit_child(spec: dict[str, Any]) -> int:
    """Build a big re-insert scenario, then fork once per headroom: limit, re-insert, report."""

    child_setup(watchdog=False)
    lc = llama_cpp()

    n_ctx = 1024
    llm = lc.Llama(
        model_path=str(model_path("llama")),
        n_ctx=n_ctx,
        n_batch=256,
        n_threads=1,
        n_threads_batch=1,
        verbose=False,
        logits_all=True,
    )
    adapter = CacheAdapter(spec["cache"], tmp=spec["tmp"])
    keys = [(BOS, *[ALPHABET[i % 3] for i in range(j, j + 900)]) for j in range(3)]
    states = {}
    for k in keys:
        llm.reset()
        llm.eval(list(k))
        states[k] = llm.save_state()
    try:
        for headroom in spec["headrooms"]:
            cache = adapter.make(1 << 40)
            with adapter.quiet():
                for k in keys:
                    cache[k] = states[k]
            key = keys[1]
            new = type(states[key])(
                **{
                    f: getattr(states[key], f)
                    for f in ("input_ids", "scores", "n_tokens", "llama_state", "llama_state_size", "seed")
                }
            )
            before = adapter.keys(cache)
            gc.collect()

            expected = [keys[0], keys[2], key]
            reinsert = functools.partial(_reinsert_under_limit, adapter, cache, key, new, before, expected, headroom)
            done = run_child(reinsert, timeout=spec["timeout"])
            text = done.stdout.strip()
            dead = {"headroom": headroom, "outcome": died(done), "state": None, "finding": None}
            print(text if text else json.dumps(dead), flush=True)
            adapter.close(cache)
            adapter.cleanup()
    finally:
        adapter.cleanup()
        llm.close()
    return 0


def run_rlimit(cache: str, headrooms: Sequence[int | None], timeout: float = 90.0) -> list[dict[str, Any]]:

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["MALLOC_ARENA_MAX"] = "1"
    tmp = tempfile.mkdtemp(prefix="lcp-rlimit-", dir=TMP)
    spec = {"cache": cache, "headrooms": list(headrooms), "tmp": tmp, "timeout": timeout / (len(headrooms) + 1)}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        child = run_child(
            [sys.executable, "-m", "faults.lcp_cache", "--rlimit-child", json.dumps(spec)],
            env=env,
            timeout=timeout,
        )
    rows = [json.loads(ln) for ln in child.stdout.splitlines() if ln.startswith("{")]
    rows = [{**r, "outcome": Outcome(r["outcome"])} for r in rows]
    if child.crashed or len(rows) < len(headrooms):
        rows.append(
            {
                "headroom": None,
                "outcome": died(child),
                "state": None,
                "finding": None,
                "escaped": f"child {child.describe()}: {child.stderr.strip()[-300:]}",
            }
        )
    return rows


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--pymem-child":
        return _pymem_child(json.loads(argv[1]))
    if len(argv) == 2 and argv[0] == "--rlimit-child":
        return _rlimit_child(json.loads(argv[1]))
    print("usage: python -m harness gate --backend llama-cpp-python-cache [--cache ram|disk]", file=sys.stderr)
    return 2


if __name__ == "__main__":  # the children of the two layers; the command is the gate
    raise SystemExit(_main(sys.argv[1:]))
