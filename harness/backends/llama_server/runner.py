"""The server backend's runner: from the gate's options to a built server, its semantics and the run.

:class:`ServerBackend` (what :mod:`harness.backends` registers) has the server chosen in one call
(:func:`harness.trees.choose.choose_builds`: ``--server-bin``, ``--source`` with ``--base``, or a pinned build),
with the semantics the model runs in and the switches it follows, and runs either
:func:`run_server_backend` (the differential machines, the eviction and full-context programs, the memory
properties, the sanitizers) or :func:`run_change_backend` (``TREE`` against ``BASE``: the change differential,
each difference shrunk on fresh servers, then the memory properties of both). What the checks are: the package's
docstring (:mod:`harness.backends.llama_server`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from hypothesis import settings
from hypothesis.errors import FlakyFailure

from harness.backends.base import SOURCE, Backend, GateOptions, GateReport, MachineSpec, Option, Out, Plan
from harness.backends.llama_server.campaign import campaign_machines, campaign_models
from harness.backends.llama_server.change import ChangeFound, ChangePair, ChangeStats, change_machine, shrink
from harness.backends.llama_server.differential import (
    LIMIT_PROGRAMS,
    MachineStats,
    Program,
    ServerMismatch,
    eviction,
    full_context,
    run_program,
    server_configs,
    server_machine,
)
from harness.backends.llama_server.limits import (
    LimitStats,
    failed_load_program,
    limits_machine,
    run_limit_program,
    shrink_steps,
)
from harness.backends.llama_server.memory import memory_and_faults
from harness.backends.llama_server.section import ServerRun, describe, hypothesis_settings, unflaked
from harness.errors import ServerStartError, UsageError
from harness.targets.llama_server import ServerConfig
from harness.targets.server_log import LOG_PROPERTIES
from harness.trees.build import PINNED_COMMIT, ServerBuild
from harness.trees.choose import ChosenServers, choose_builds
from properties.run import run_seeded

__all__ = ["MODEL_EXACT_SKIP", "ServerBackend", "ServerOptions", "run_change_backend", "run_server_backend"]


@dataclass(frozen=True)
class ServerOptions:
    """The server backend's own options (:attr:`ServerBackend.options`): which llama-server it builds or takes."""

    asan: bool = False  # the sanitizer build
    source: Path | None = None  # a llama.cpp tree to build and test
    server_bin: Path | None = None  # a llama-server binary built elsewhere
    base: str | None = None  # the tree (or git revision of ``source``) the change starts from


class ServerBackend(Backend):
    name = "server"
    options_type = ServerOptions
    options = (
        Option("asan", "--asan", {"action": "store_true", "help": "the AddressSanitizer build (shared)"}),
        SOURCE,
        Option("base", "--base", {
            "metavar": "TREE|REV",
            "help": "with --source: the tree the change starts from (a directory, an upstream build by name as for "
            "--source, or a revision of the git checkout --source names); both are built and driven request for "
            "request, and every difference between them is attributed to the change"}),
        Option("server_bin", "--server-bin", {
            "metavar": "PATH", "type": Path,
            "help": "test this llama-server binary (built elsewhere); needs --semantics"}),
    )

    def run(self, report: GateReport, opts: GateOptions, out: Out) -> None:
        own = opts.of(ServerOptions)
        chosen = choose_builds(
            source=own.source,
            base=own.base,
            server_bin=own.server_bin,
            asan=own.asan,
            semantics=opts.semantics,
            semantics_given=opts.semantics_given,
            log=lambda m: out("  build: " + m),
        )
        report.semantics = chosen.semantics
        if chosen.base is not None:
            run_change_backend(report, chosen, opts.profile, opts.seed, opts.max_examples, out)
        else:
            run_server_backend(report, chosen, opts.profile, opts.seed, opts.max_examples, out)

    def campaign_machines(self, plan: Plan) -> list[MachineSpec]:
        return campaign_machines(plan, self.name)

    def campaign_models(self, plan: Plan) -> tuple[frozenset[str], bool]:
        return campaign_models(), True


MODEL_EXACT = ("the differential machines (slot, cache_n and each cache event against the model), the fixed programs "
               "at the limits, the memory step (the save's peak and each fault's outcome against the model's)")
MODEL_FREE = (f"the drawn configurations: the server's log held to {', '.join(LOG_PROPERTIES)}; every cached answer "
              "against a fresh server's (restore_equivalence); no crash or hang; the sanitizers")
"""What the server gate skips and still runs on a tree whose prompt cache the model cannot read
(:attr:`~harness.trees.switches.Switches.prompt_cache_replaced`)."""
MODEL_EXACT_SKIP = "server backend: model-exact checks"
"""The skip's name in the report (the steps after the backend that need the model skip too)."""


def run_server_backend(
    report: GateReport, chosen: ChosenServers, profile: str, seed: int, max_examples: int | None, out: Out
) -> None:
    """``gate --backend server``: differential machines, full context, memory, faults, sanitizers."""
    build, semantics, how = chosen.build, chosen.semantics, chosen.how
    replay = f"python -m harness gate --backend server {build.replay_flags}"
    if not build.by_name:
        replay += f" --semantics {semantics}"
    replay += f" --profile {profile} --seed {seed}"
    binary = build.binary
    out(f"gate: backend=server build={build.origin} semantics={semantics} profile={profile} seed={seed} "
        f"commit={report.commit}")  # fmt: skip
    out(f"  binary {binary}" + (" (AddressSanitizer)" if build.asan else ""))
    if how:
        out(f"  semantics {semantics}: {how}")
    out("  the model follows: " + chosen.follows)
    if chosen.unknown_flags:
        out(f"  this llama-server does not know {', '.join(chosen.unknown_flags)}: its servers run without them (its "
            "own fixed behaviour; the model, which follows them, may differ there: drift, not a finding)")
    pinned = describe(build, out)
    if build.origin == "build asan" and not build.asan:
        raise UsageError(
            f"{binary} is not built with AddressSanitizer; rebuild: python -m harness build-server --asan --force"
        )
    note = "" if pinned else (
        f" [the model is pinned to llama.cpp {PINNED_COMMIT} and this {'tree' if build.tree else 'binary'} is not "
        "that tree: the divergence is either your change or upstream moving on since; --base BASE (the tree your "
        "change starts from) tells them apart]"
    )  # fmt: skip
    run = ServerRun(report, build, semantics, replay, out, pinned, note)
    run.version([build])
    hs = hypothesis_settings(profile, max_examples)
    replaced = chosen.switches.prompt_cache_replaced
    with tempfile.TemporaryDirectory(prefix="server-gate-") as logs:
        if build.asan:
            # leaks are reported at exit, into the server's log
            os.environ.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
        if replaced.on:  # the model's policy describes nothing here: only the checks that need no model of it
            why = (f"the model cannot read this tree's prompt cache ({replaced.where}): skipped, being model-exact: "
                   f"{MODEL_EXACT}; still run: {MODEL_FREE}")  # fmt: skip
            report.skip(MODEL_EXACT_SKIP, why)
            out(f"  [skip] {why}")
            _limits(run, binary, hs, seed, logs)
            run.sanitizers(logs)
            run.known_near_ties()
            return
        _machines(run, binary, semantics, hs, seed, logs)
        _limits(run, binary, hs, seed, logs)
        _programs(run, binary, semantics, logs)
        if not build.asan:
            try:
                t0 = time.perf_counter()
                checked = memory_and_faults(report, run.section, build.label, semantics, binary, logs, run.fail, out)
                run.passed(time.perf_counter() - t0, checked)
            except ServerMismatch as e:
                run.mismatch(e, "server-memory")
            except ServerStartError as e:
                if pinned:  # the pinned builds start on the big-state model: a start failure is the environment's
                    raise
                _skip_memory(report, e, out)
        run.sanitizers(logs)
    run.known_near_ties()


def _programs(run: ServerRun, binary: Path, semantics: str, logs: str) -> None:
    """The fixed programs, each at one of the cache's limits (:data:`LIMIT_PROGRAMS`), one row each."""
    try:
        t0 = time.perf_counter()
        rows = eviction(binary, semantics, logs)
        run.passed(time.perf_counter() - t0, Counter(rows[-1].log_checked))
        run.section["requests"] += len(rows)
        run.section["evictions"] += rows[-1].evictions
        run.out(
            f"  [ok  ] eviction: jamba --cache-ram 1, {len(rows)} requests, {rows[-1].evictions} evictions "
            f"seen in the log and predicted, cache_n {[r.cache_n for r in rows[-3:]]} for the returning prompts"
        )
    except ServerMismatch as e:
        run.mismatch(e, "server-eviction")
    try:
        t0 = time.perf_counter()
        rows = full_context(binary, semantics, logs)
        run.passed(time.perf_counter() - t0, Counter(rows[-1].log_checked))
        run.section["requests"] += len(rows)
        run.out(f"  [ok  ] full context: jamba n_ctx=1024, {len(rows)} requests, cache_n " + ", ".join(
            str(r.cache_n) for r in rows))  # fmt: skip
    except ServerMismatch as e:
        run.mismatch(e, "server-full-context")
    for name in ("checkpoint-cap", "token-limit", "load-threshold", "prefix-entry"):
        cfg, program = LIMIT_PROGRAMS[name]()
        try:
            t0 = time.perf_counter()
            rows = run_program(cfg, program, binary, semantics, logs)
            run.passed(time.perf_counter() - t0, Counter(rows[-1].log_checked))
            run.section["requests"] += len(rows)
            run.out(f"  [ok  ] {name}: {cfg.name} --ctx-checkpoints {cfg.ctx_checkpoints} --cache-ram "
                f"{cfg.cache_ram_mib} -c {cfg.n_ctx}, {len(rows)} requests, {rows[-1].evictions} evictions, "
                f"the log's checks {dict(sorted(rows[-1].log_checked.items()))}")  # fmt: skip
        except ServerMismatch as e:
            run.mismatch(e, f"server-{name}")
    try:  # a load that fails for want of cells, held by the log alone (the model does not count cells)
        t0 = time.perf_counter()
        cfg, prompts = failed_load_program()
        done = run_limit_program(cfg, prompts, binary, logs, run.build.replay_expr)
        checked = done.log.checked + done.checked
        run.passed(time.perf_counter() - t0, checked)
        run.section["requests"] += len(prompts)
        run.out(f"  [ok  ] failed-load: {cfg.name} -c {cfg.n_ctx} --no-cache-idle-slots, {len(prompts)} requests, "
                f"{checked['restore_failure']} failed loads held to restore_failure, the log's checks "
                f"{dict(sorted(checked.items()))}")  # fmt: skip
    except ServerMismatch as e:
        run.mismatch(e, "server-failed-load")


def _skip_memory(report: GateReport, e: ServerStartError, out: Callable[[str], None]) -> None:
    """The memory checks' server (the generated big-state model, MiBs of checkpoints) did not start on this
    tree's build: a check that cannot run on a tree is a skip with its reason, never the verdict."""
    why = f"the memory checks' llama-server did not start on this tree's build with the big-state model: {e}"
    report.skip("server backend: memory checks", why)
    out(f"  [skip] memory checks: {why}")


def _limits(run: ServerRun, binary: Path, hs: settings, seed: int, logs: str) -> None:
    """The drawn configurations (:mod:`harness.backends.llama_server.limits`): the server's own log at each step,
    and each cached answer against a fresh server's (restore_equivalence at every limit the draws reach)."""
    stats = LimitStats()
    t0 = time.perf_counter()
    status = "ok  "
    try:
        run_seeded(limits_machine(binary, stats, logs, run.build.replay_expr, fresh=True), hs, seed)
        run.passed(time.perf_counter() - t0, stats.checked)
    except ServerMismatch as e:
        status = "FAIL"
        run.mismatch(_shrunk(e, stats, run.out), "server-limits")
    except FlakyFailure as group:
        found = unflaked(group, ServerMismatch)
        if found is None:
            raise
        status = "FAIL"  # what the server's log showed once is filed, said to be flaky
        flaky = f"{found.message} [flaky: Hypothesis' second run of the same program did not show it]"
        run.mismatch(ServerMismatch(found.name, flaky, found.program, found.kind), "server-limits")
    except ServerStartError as e:
        status = "FAIL"
        run.section["server_crashes"] += 1
        run.fail("server", "crash", str(e), "", "server-limits")
    run.section["requests"] += stats.requests
    run.section["near_tie_flips"] += stats.near_ties
    run.out(f"  [{status}] drawn configurations {stats.examples:>3} servers, {stats.requests} requests, {stats.erases} "
            f"slot erases, {stats.boundaries} context edges; the checks {dict(sorted(stats.checked.items()))} "
            f"{time.perf_counter() - t0:5.1f}s")  # fmt: skip


def _shrunk(e: ServerMismatch, stats: LimitStats, out: Out) -> ServerMismatch:
    """The drawn configuration's failure with its steps shrunk on fresh servers
    (:func:`~harness.backends.llama_server.limits.shrink_steps`), the shrink's line in its message; as it was when
    the failure does not show again."""
    if stats.last is None:
        return e
    out(f"  shrinking the {len(stats.last.actions)} steps that failed {e.name} on fresh servers ...")
    small, how = shrink_steps(stats.last, e.name)
    if small is None:
        return ServerMismatch(e.name, f"{e.message} [{how}]", e.program, e.kind)
    return ServerMismatch(small.name, f"{small.message} [{how}]", small.program, small.kind)


def _machines(run: ServerRun, binary: Path, semantics: str, hs: settings, seed: int, logs: str) -> None:
    """The differential machine of every configuration, one row each."""
    for cfg in server_configs():
        stats = MachineStats()
        t0 = time.perf_counter()
        cls = server_machine(cfg, binary, semantics, stats, logs, run.build.replay_expr)
        status = "ok  "
        try:
            run_seeded(cls, hs, seed)
        except ServerMismatch as e:
            status = "FAIL"
            run.mismatch(e, f"server-{cfg.name}")
        except FlakyFailure as group:
            found = unflaked(group, ServerMismatch)
            if found is None:
                raise
            status = "FAIL"  # the model is the oracle: what the server answered once is filed, said to be flaky
            flaky = f"{found.message} [flaky: Hypothesis' second run of the same program did not show it]"
            run.mismatch(ServerMismatch(found.name, flaky, found.program, found.kind), f"server-{cfg.name}")
        except ServerStartError as e:
            status = "FAIL"
            run.section["server_crashes"] += 1
            run.fail("server", "crash", str(e), "", f"server-{cfg.name}")
        for k in ("requests", "near_tie_flips", "evictions", "cache_loads"):
            run.section[k] += getattr(stats, k)
        checked = Counter({"cache_n": stats.requests, "output": stats.output_checks,
                           "restore_equivalence": stats.restore_checks}) + stats.log_checks  # fmt: skip
        run.passed(time.perf_counter() - t0, checked)
        run.out(
            f"  [{status}] {cfg.name:<20} {stats.requests:>4} requests ({stats.cache_hits} reused a prefix, "
            f"{stats.cache_loads} cache loads, {stats.evictions} evictions), {stats.output_checks} outputs "
            f"checked against a fresh server"
            + (f", {stats.drafted} draft tokens" if cfg.draft else "")
            + f" {time.perf_counter() - t0:5.1f}s"
        )


def run_change_backend(
    report: GateReport, chosen: ChosenServers, profile: str, seed: int, max_examples: int | None, out: Out
) -> None:
    """``gate --backend server --source TREE --base BASE``: the change differential, then the memory
    properties on ``TREE`` with ``BASE``'s figures beside them."""
    tree, semantics, base_semantics, how = chosen.build, chosen.semantics, chosen.base_semantics, chosen.how
    assert chosen.base is not None, "run_change_backend needs a BASE"
    base = chosen.base
    replay = (f"python -m harness gate --backend server {tree.replay_flags} --base {base.replay_flags.split(' ', 1)[1]}"
              f" --profile {profile} --seed {seed}")  # fmt: skip
    out(f"gate: backend=server change TREE={tree.origin} BASE={base.origin} semantics={semantics} "
        f"(BASE {base_semantics}) profile={profile} seed={seed} commit={report.commit}")  # fmt: skip
    if how:
        out(f"  semantics {semantics}: {how}")
    out("  the model follows: " + chosen.follows)
    if chosen.unknown_flags:
        out(f"  this llama-server does not know {', '.join(chosen.unknown_flags)}: its servers run without them (its "
            "own fixed behaviour; the model, which follows them, may differ there: drift, not a finding)")
    describe(tree, out)
    base_pinned = describe(base, out)
    run = ServerRun(report, tree, semantics, replay, out, pinned=base_pinned)
    run.section.update({"base": base.origin, "base_binary": str(base.binary), "base_semantics": base_semantics,
                        "base_pinned": base_pinned,
                        "changes": 0, "same_answers": 0, "drift": [], "unconfirmed": []})  # fmt: skip
    run.version([tree, base])
    hs = hypothesis_settings(profile, max_examples)
    with tempfile.TemporaryDirectory(prefix="server-change-") as logs:
        if tree.asan:
            os.environ.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")

        pair = _PairRun(run, tree, base, base_semantics, base_pinned, logs)
        for cfg in server_configs():
            pair.machine(cfg, hs, seed)
        for name, make in LIMIT_PROGRAMS.items():
            pair.program(name, *make())
        if not tree.asan:
            _memory_change(report, run, tree, base, semantics, base_semantics, logs, out)
        run.sanitizers(logs)
    if run.section["drift"]:
        out(f"  upstream drift: {len(run.section['drift'])} configuration(s) where BASE answers unlike the model "
            f"(pinned to {PINNED_COMMIT}); not the change's, not failing")  # fmt: skip
    run.known_near_ties()


class _PairRun:
    """The change differential's machines and programs for one run: each difference shrunk and filed, each
    drift reported (or, on a pinned ``BASE``, filed as the model's mismatch)."""

    def __init__(self, run: ServerRun, tree: ServerBuild, base: ServerBuild, base_semantics: str, base_pinned: bool,
                 logs: str) -> None:  # fmt: skip
        self.run, self.tree, self.base, self.base_semantics = run, tree, base, base_semantics
        self.base_pinned, self.logs = base_pinned, logs
        self.exprs = (tree.replay_expr, base.replay_expr)
        self.shrunk = False

    def machine(self, cfg: ServerConfig, hs: settings, seed: int) -> None:
        stats = ChangeStats()
        t0 = time.perf_counter()
        status = "ok  "
        cls = change_machine(cfg, self.tree.binary, self.base.binary, self.base_semantics, stats, self.logs,
                             self.exprs)  # fmt: skip
        try:
            run_seeded(cls, hs, seed)
        except ChangeFound as e:
            status = "FAIL"
            self.changed(e, cfg, f"server-{cfg.name}")
        except FlakyFailure as group:
            found = unflaked(group, ChangeFound)
            if not isinstance(found, ChangeFound):
                raise
            status = "FAIL" if self.changed(found, cfg, f"server-{cfg.name}", flaky=True) else "ok  "
        except ServerStartError as e:
            status = "FAIL"
            self.run.section["server_crashes"] += 1
            self.run.fail("server", "crash", str(e), "", f"server-{cfg.name}")
        self.account(stats, f"server-{cfg.name}")
        self.run.passed(time.perf_counter() - t0, Counter({"change": stats.requests}))
        self.run.out(f"  [{status}] {cfg.name:<20} {stats.requests:>4} requests to both, {stats.same} answered alike "
                     f"(slot, cache_n, tokens, cache events) {time.perf_counter() - t0:5.1f}s")  # fmt: skip

    def program(self, name: str, cfg: ServerConfig, program: Program) -> None:
        stats = ChangeStats()
        try:
            with ChangePair(cfg, self.tree.binary, self.base.binary, self.base_semantics, self.logs,
                            tree_expr=self.exprs[0], base_expr=self.exprs[1]) as p:  # fmt: skip
                for toks, n in program:
                    step = p.request(toks, n)
                    stats.requests += 1
                    if step.difference is not None:
                        raise ChangeFound(step, p.sent, p.program())
                    stats.same += 1
                if p.drift is not None:
                    stats.drift.append(f"{cfg.name}: {p.drift}")
            self.run.out(f"  [ok  ] {name}: {len(program)} requests to both, answered alike")
        except ChangeFound as e:
            self.changed(e, cfg, f"server-{name}")
        self.account(stats, f"server-{name}")

    def changed(self, e: ChangeFound, cfg: ServerConfig, machine: str, *, flaky: bool = False) -> bool:
        """File a difference as the change's: the first one of the run shrunk on fresh server pairs (minutes of
        real requests), the others with their whole program. A ``flaky`` one (Hypothesis' second run of the
        same program did not show it) is the change's only if it shows again on fresh servers; else it is kept
        as ``unconfirmed`` with its program, printed, and not filed (False): a difference neither run repeats
        may be both builds' timing, and the gate says only what it saw."""
        pair = ChangePair(cfg, self.tree.binary, self.base.binary, tree_expr=self.exprs[0], base_expr=self.exprs[1])
        if self.shrunk and not flaky:
            said = "not shrunk: the run's first change is"
            sent, step = e.sent, e.step
        else:
            self.run.out(f"  change in {machine}: {e.step.difference} (request {e.step.index}"
                         f"{'; not seen again when Hypothesis ran its program twice' if flaky else ''}); "
                         "shrinking on fresh servers")  # fmt: skip
            sent, found, said = shrink(cfg, self.tree.binary, self.base.binary, e.sent, log_dir=self.logs,
                                       out=self.run.out)  # fmt: skip
            if found is None and flaky:
                what = (f"{machine}: {e.step.describe()} (seen once; not in Hypothesis' second run of the program "
                        "nor in a replay on fresh servers)")  # fmt: skip
                self.run.section["unconfirmed"].append({"difference": what, "program": pair.program(e.sent)})
                self.run.out(f"  unconfirmed difference, not attributed to the change (not failing): {what}")
                return False
            step = found or e.step
            self.shrunk = True
        message = step.describe() + f" [{len(sent)} of {len(e.sent)} requests; {said}]"
        self.run.mismatch(ServerMismatch("change", message, pair.program(sent), e.kind), machine)
        return True

    def account(self, stats: ChangeStats, machine: str) -> None:
        self.run.section["requests"] += stats.requests
        self.run.section["same_answers"] += stats.same
        for d in stats.drift:
            if self.base_pinned:  # BASE is the tree the model mirrors: a disagreement is the model's or upstream's
                self.run.fail("cache_n", "violation", f"BASE against the model: {d}", "", machine)
            else:
                self.run.section["drift"].append(d)
                self.run.out(f"  upstream drift (BASE against the model {PINNED_COMMIT}; reported, not failing): {d}")


def _judge_against_base(run: ServerRun, failed: list[tuple[str, str, str, str, str]], base: ServerBuild,
                        base_semantics: str, logs: str, out: Callable[[str], None]) -> None:  # fmt: skip
    """File ``TREE``'s memory failures that ``BASE`` does not share; say the others are ``BASE``'s too."""
    if not failed:
        return
    out(f"  TREE failed {', '.join(sorted({f[0] for f in failed}))}: the same memory properties on BASE")
    on_base: list[tuple[str, str, str, str, str]] = []
    scratch = SimpleNamespace(known=[])  # BASE's known-finding rows are not this report's
    memory_and_faults(scratch, {"fault_trials": 0, "server_crashes": 0}, "base", base_semantics, base.binary, logs,
                      lambda *f: on_base.append(f), lambda m: out("  [base]" + m[1:]))  # fmt: skip
    base_props = {(f[0], f[1], f[4]) for f in on_base}
    shared = [f for f in failed if (f[0], f[1], f[4]) in base_props]
    run.section["base_failures"] = [{"property": f[0], "kind": f[1], "message": f[2]} for f in shared]
    for f in failed:
        if f in shared:
            out(f"  [base] {f[0]} ({f[4]}) fails on BASE as on TREE: upstream's, not the change's")
        else:
            run.fail(*f)


def _memory_change(report: GateReport, run: ServerRun, tree: ServerBuild, base: ServerBuild, semantics: str,
                   base_semantics: str, logs: str, out: Callable[[str], None]) -> None:  # fmt: skip
    """The memory properties on ``TREE`` (as without ``--base``), and ``BASE``'s save peak beside it. A property
    ``TREE`` fails is run on ``BASE`` too: failed there the same way, it is upstream's, not the change's (said, kept in
    the section's ``base_failures``, not failing); only what ``BASE`` holds and ``TREE`` breaks fails the gate."""
    failed: list[tuple[str, str, str, str, str]] = []
    try:
        t0 = time.perf_counter()
        checked = memory_and_faults(report, run.section, tree.label, semantics, tree.binary, logs,
                                    lambda *f: failed.append(f), out,
                                    other=("base", base.binary, base_semantics))  # fmt: skip
        run.passed(time.perf_counter() - t0, checked)
        _judge_against_base(run, failed, base, base_semantics, logs, out)
    except ServerMismatch as e:
        run.mismatch(e, "server-memory")
    except ServerStartError as e:
        _skip_memory(report, e, out)
    m = run.section.get("memory", {})
    if "base" in m and tree.label in m and m[tree.label]["rss_peak_bytes"] > 0:
        ratio = m["base"]["rss_peak_bytes"] / m[tree.label]["rss_peak_bytes"]
        run.section["rss_ratio_base_over_tree"] = round(ratio, 2)
        out(f"  the change's memory difference: a save's RSS peak BASE {m['base']['rss_peak_bytes']} B, TREE "
            f"{m[tree.label]['rss_peak_bytes']} B (BASE/TREE = {ratio:.2f})")  # fmt: skip
