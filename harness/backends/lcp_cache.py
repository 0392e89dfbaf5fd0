"""The gate's ``llama-cpp-python-cache`` backend: llama-cpp-python's own prompt caches under the generic properties.

How it runs (:func:`run_lcp_gate`, on ``--cache ram`` or ``disk``): the state machine of
:mod:`properties.lcp_machine` per model (``llama``: a KV cache; ``mamba``: recurrent) on the target
of :mod:`harness.targets.lcp_cache`. A failing property is diagnosed: when it is one of
:data:`~properties.lcp_machine.KNOWN_LCP_FINDINGS`, it is reported, the reference model adopts
upstream's behaviour for it, and the machine runs again to check everything else; an undiagnosed
failure goes into ``"failures"`` with its shrunk program and a replay command. Then the two
child-process layers of :mod:`faults.lcp_cache`: CPython allocation failures swept over
``cache[key] = state``, and ``RLIMIT_AS`` in a forked child around a re-insert. Every temporary
directory is removed. JSON: ``"llama_cpp_cache"``.

Campaign machines: the RAM and the disk cache on each of :data:`MACHINE_ARCHS`, known findings
modelled as upstream behaves (as the gate does once it has seen them), 20 steps, batch 5.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis.stateful import RuleBasedStateMachine

from faults.kinds import Outcome
from faults.lcp_cache import run_rlimit, sweep_pymem
from faults.pymem import pymem_unavailable
from harness.backends.base import (
    Backend,
    Failure,
    GateOptions,
    GateReport,
    MachineResult,
    MachineSpec,
    Option,
    Out,
    Plan,
)
from harness.findings import KnownRow, finding
from harness.targets.lcp_cache import CACHES, CacheAdapter, ModelEnv
from properties.lcp_machine import (
    KNOWN_BY_NAME,
    KNOWN_LCP_FINDINGS,
    PROPERTIES,
    STEPS,
    LcpViolation,
    Stats,
    machine_class,
    machine_settings,
)
from properties.machine import MachineConfig
from properties.run import run_seeded
from properties.teardown import teardown_errors

__all__ = ["DEFAULT_EXAMPLES", "MACHINE_ARCHS", "LcpCacheBackend", "LcpOptions", "LcpSection", "run_lcp_gate"]

MACHINE_ARCHS = ("llama", "mamba")
DEFAULT_EXAMPLES = 40


def _known(name: str, cache: str) -> bool:
    f = KNOWN_BY_NAME.get(name)
    return f is not None and cache in f.scope


@dataclass
class _GateRun:
    """One gate run on one cache kind: what it found so far, and the layers that add to it."""

    cache: str
    seed: int
    out: Callable[[str], None]
    stats: Stats = field(default_factory=Stats)
    findings: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    out_of_scope: list[dict[str, Any]] = field(default_factory=list)
    tolerate: set[str] = field(default_factory=set)

    @property
    def replay(self) -> str:
        return f"python -m harness gate --backend llama-cpp-python-cache --cache {self.cache} --seed {self.seed}"

    def found(self, name: str, evidence: str, where: str) -> None:
        f = KNOWN_BY_NAME[name]
        if name not in self.findings:
            self.findings[name] = {
                "name": name,
                "property": f.property,
                "reproducer": f.reproducer,
                "title": f.title,
                "detail": f.detail,
                "evidence": evidence,
                "where": where,
                "also": [],
            }
            self.out(f"  known finding {name} ({f.property}): {evidence}")
        elif where not in self.findings[name]["where"] and all(where not in a for a in self.findings[name]["also"]):
            self.findings[name]["also"].append(f"{where}: {evidence}")  # the first sighting per further layer
            self.out(f"  known finding {name} also shown by {where}: {evidence}")

    def fail(self, prop: str, message: str, machine: str, program: str = "", teardown: list[str] | None = None) -> None:
        self.failures.append(
            {"property": prop, "message": message, "machine": machine, "program": program, "replay": self.replay,
             "teardown": teardown or []}
        )  # fmt: skip

    def machines(self, arch: str, n: int) -> None:
        """The machine on ``arch``, again after each known finding it shows, until it passes or fails."""
        env = ModelEnv(arch)
        adapter = CacheAdapter(self.cache)
        try:
            for _ in range(len(KNOWN_LCP_FINDINGS) + 1):
                cls = machine_class(env, adapter, frozenset(self.tolerate), self.stats)
                t1 = time.perf_counter()
                try:
                    run_seeded(cls, machine_settings(n), self.seed)
                    self.out(
                        f"  machine {cls.__name__}: passed in {time.perf_counter() - t1:.1f}s "
                        f"(tolerating {sorted(self.tolerate) or 'nothing'})"
                    )
                    return
                except LcpViolation as v:
                    program = "\n".join(getattr(v, "__notes__", []))
                    if v.finding is not None and _known(v.finding, self.cache) and v.finding not in self.tolerate:
                        self.found(v.finding, v.message, f"machine {cls.__name__}")
                        self.tolerate.add(v.finding)
                        continue
                    self.fail(v.name, v.message, cls.__name__, program, teardown_errors(v))
                    self.out(f"  FAIL {v.name}: {v.message}\n{program}\n  replay: {self.replay}")
                    return
                except Exception as e:
                    program = "\n".join(getattr(e, "__notes__", []))
                    self.fail("crash", f"{type(e).__name__}: {e}", cls.__name__, program, teardown_errors(e))
                    self.out(f"  FAIL crash: {type(e).__name__}: {e}\n{program}\n  replay: {self.replay}")
                    return
        finally:
            adapter.cleanup()
            env.close()

    def pymem_layer(self) -> None:
        """CPython allocator failures inside ``cache[key] = state`` (children)."""
        if pymem_unavailable() is not None:
            self.out("  pymem: skipped (no _testcapi.set_nomemory)")
            return
        for act in ("reinsert", "evict"):
            stride = 1 if self.cache == "ram" else 7
            rows = sweep_pymem(self.cache, act, max_points=120 if self.cache == "ram" else 60, stride=stride)
            reached = [r for r in rows if r["reached"]]
            tally = Counter(r["outcome"] for r in reached)
            states = Counter(r["state"] for r in reached if r["state"])
            self.stats.checked["fault_atomic"] += len(reached)
            self.out(
                f"  pymem {act}: {len(reached)} points (stride {stride}): "
                + ", ".join(f"{o} {k}" for o, k in tally.items())
                + " (cache "
                + ", ".join(f"{s} {k}" for s, k in states.items())
                + ")"
            )
            for r in reached:
                if r["finding"] and _known(r["finding"], self.cache):
                    self.found(
                        r["finding"],
                        f"CPython allocation #{r['nth']} failing in cache[key] = state ({act}): "
                        f"{r['escaped']}; entries {r['before']} -> {r['after']} (key lengths)",
                        f"pymem {act}",
                    )
                elif r["outcome"] in (Outcome.ABORTED, Outcome.KILLED):  # the interpreter died (e.g. in sqlite3)
                    self.out_of_scope.append({"layer": "pymem", "act": act, **r})
                elif r["outcome"] not in (Outcome.OK, Outcome.ACCEPTED):
                    self.fail("fault_atomic", f"pymem {act} #{r['nth']}: {r}", "pymem")

    def rlimit_layer(self) -> None:
        """A real address-space limit around a re-insert of a ~1.2 MB state (forked children)."""
        if not (hasattr(os, "fork") and os.path.exists("/proc/self/status")):
            return
        rows = run_rlimit(self.cache, [None, 256 * 1024])
        self.stats.checked["fault_atomic"] += len(rows)
        for r in rows:
            self.out(f"  rlimit headroom {r.get('headroom')}: {r['outcome']} ({r.get('state')}, {r.get('escaped')})")
            if r.get("finding") and _known(r["finding"], self.cache):
                self.found(
                    r["finding"],
                    f"RLIMIT_AS at +{r['headroom']} bytes around re-inserting a {r['state_bytes']}-byte "
                    f"state: {r['escaped']}; the cached entry is gone",
                    "rlimit",
                )
            elif r["outcome"] not in (Outcome.OK, Outcome.ACCEPTED):
                self.fail("fault_atomic", f"rlimit: {r}", "rlimit")


def run_lcp_gate(
    cache: str = "ram", *, seed: int = 0, max_examples: int | None = None, out: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run every property on ``cache`` (``"ram"`` or ``"disk"``); known findings are reported, not failed.

    Returns ``{"cache", "checks", "properties", "findings", "failures", "out_of_scope", "seconds"}``:
    ``checks`` counts the property checks made (``properties`` per property), ``findings`` the known
    findings shown (name, property, reproducer, title, evidence), ``failures`` every failure that is not a
    known finding (property, message, shrunk program, replay command), ``out_of_scope`` pymem trials whose
    child died inside the interpreter or sqlite3 (not attributable to the cache; reported, never failed).
    """
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {CACHES}, not {cache!r}")
    t0 = time.perf_counter()
    n = max_examples or DEFAULT_EXAMPLES
    run = _GateRun(cache, seed, out)
    out(
        f"llama-cpp-python cache gate: cache={cache} seed={seed} max_examples={n} steps={STEPS} "
        f"archs={' '.join(MACHINE_ARCHS)}"
    )
    for arch in MACHINE_ARCHS:
        run.machines(arch, n)
    t1 = time.perf_counter()
    run.pymem_layer()
    out(f"  pymem layer: {time.perf_counter() - t1:.1f}s")
    t1 = time.perf_counter()
    run.rlimit_layer()
    out(f"  rlimit layer: {time.perf_counter() - t1:.1f}s")

    for p in PROPERTIES:
        shown = [f["name"] for f in run.findings.values() if f["property"] == p]
        failed = any(f["property"] == p for f in run.failures)
        verdict = "FAILED" if failed else ("finding " + ", ".join(shown) if shown else "holds")
        out(f"  {p:<13} {run.stats.checked[p]:>6} checks  {verdict}")
    res = {
        "cache": cache,
        "checks": sum(run.stats.checked.values()),
        "properties": {p: run.stats.checked[p] for p in PROPERTIES},
        "findings": list(run.findings.values()),
        "failures": run.failures,
        "out_of_scope": run.out_of_scope,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    out(
        f"{'PASS' if not run.failures else 'FAIL'} ({len(run.findings)} known findings, {len(run.failures)} failures, "
        f"{res['seconds']}s)"
    )
    return res


_FINDING_KEYS = ("name", "property", "reproducer", "title", "detail", "evidence")  # a finding's row in the section


@dataclass(frozen=True)
class LcpSection:
    """The llama-cpp-python cache backend's part of the gate's JSON (``llama_cpp_cache``), from the result of
    :func:`run_lcp_gate`: the cache, the properties checked, the findings with their evidence."""

    res: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        res = self.res
        return {
            "llama_cpp_cache": {
                "cache": res["cache"],
                "checks": res["checks"],
                "properties": res["properties"],
                "findings": [{k: f[k] for k in _FINDING_KEYS} for f in res["findings"]],
                "out_of_scope": res["out_of_scope"],
                "seconds": res["seconds"],
            }
        }


def _run_lcp(report: GateReport, semantics: str, cache: str, seed: int, max_examples: int | None, out: Out) -> None:
    """llama-cpp-python's own prompt caches (LlamaRAMCache / LlamaDiskCache) under the generic properties."""
    out(f"gate: backend=llama-cpp-python-cache cache={cache} seed={seed} commit={report.commit}")
    res = run_lcp_gate(cache, seed=seed, max_examples=max_examples, out=lambda line: out("  " + line))
    report.sections["llama_cpp_cache"] = LcpSection(res)
    for f in res["findings"]:
        row = KnownRow(finding(f["name"]), f"llama-cpp-python {cache} cache", "reproduced")
        row.property, row.message = f["property"], f["evidence"]
        report.known.append(row)
    for f in res["failures"]:
        failure = Failure(
            f["property"], "violation", f["message"], f.get("program", ""), f["replay"], f.get("machine", "lcp"), 0,
            list(f.get("teardown", [])),
        )  # fmt: skip
        result = MachineResult(MachineConfig(semantics), res["seconds"], failure, Counter(), Counter(), [])
        report.machines.append(result)


@dataclass(frozen=True)
class LcpOptions:
    """The llama-cpp-python-cache backend's own options (:attr:`LcpCacheBackend.options`)."""

    cache: str = "ram"  # which of llama-cpp-python's caches: ram or disk


class LcpCacheBackend(Backend):
    name = "llama-cpp-python-cache"
    options_type = LcpOptions
    options = (Option("cache", "--cache", {"choices": ["ram", "disk"], "help": "which cache (default: ram)"}),)
    semantics_axis = False

    def run(self, report: GateReport, opts: GateOptions, out: Out) -> None:
        _run_lcp(report, opts.semantics, opts.of(LcpOptions).cache, opts.seed, opts.max_examples, out)

    def campaign_machines(self, plan: Plan) -> list[MachineSpec]:
        return [_campaign_spec(cache, arch) for cache in CACHES for arch in MACHINE_ARCHS]

    def campaign_models(self, plan: Plan) -> tuple[frozenset[str], bool]:
        return frozenset(MACHINE_ARCHS), False


def _campaign_spec(cache: str, arch: str) -> MachineSpec:
    tolerate = frozenset(f.id for f in KNOWN_LCP_FINDINGS if cache in f.scope)
    name = f"LcpCache_{cache}_{arch}"

    def make() -> type[RuleBasedStateMachine]:
        cls = machine_class(ModelEnv(arch), CacheAdapter(cache), tolerate, Stats())
        cls.__name__ = cls.__qualname__ = name  # the database key is made from it
        return cls

    def header() -> list[str]:
        return [
            "from harness.targets.lcp_cache import CacheAdapter, ModelEnv",
            "from properties import lcp_machine",
            f"{name} = lcp_machine.machine_class(ModelEnv({arch!r}), CacheAdapter({cache!r}), "
            f"frozenset({sorted(tolerate)!r}), lcp_machine.Stats())",
        ]

    return MachineSpec(name, LcpCacheBackend.name, STEPS, 5, make, header)
