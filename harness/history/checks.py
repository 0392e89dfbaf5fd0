"""What ``history`` asks of each build: is the behaviour there (:data:`PRESENT`), not there (:data:`ABSENT`), or can
this build not tell (:data:`SKIPPED`, with why: ``git bisect skip``)?

Three kinds of check, each run on a built ``llama-server``:

* :class:`ReproducerCheck` (``history FINDING``, a finding's id): the finding's standalone reproducer under
  ``fixtures/findings/`` with the binary as its first argument (a finding whose ``takes_binary`` is set). Exit 1
  is present, 0 absent; any other end (exit 2 "not shown", an exception such as a server that will not start with
  the reproducer's flags on an old build) is skipped with its last line. The reproducer runs through
  :mod:`harness.history.reproducer`, so a traceback is never read as the exit 1 of a finding.
* :class:`ProgramCheck` (``program:NAME``): one of the gate's fixed programs at the cache's limits
  (:data:`~harness.backends.llama_server.differential.LIMIT_PROGRAMS`), checked only by the server's own ``-lv 4``
  log (:class:`~harness.targets.server_log.CacheLog`), never by the model: the model knows one commit, the log's
  properties hold on every tree. Present when a property fails (``program:NAME:PROPERTY``: when that one does).
* :class:`LayerCheck` (a libllama finding's id: the llama backend's or the contract machine's): that layer run on
  the build's own ``libllama.so`` through the driver bound from its tree's header (:mod:`harness.trees.driver`):
  ``gate --backend llama`` or ``contract``, once per build for all the findings of the layer. Present when the run
  shows the finding, absent when it ran and did not (only a finding that run shows on the pinned tree:
  :data:`RUN_SHOWS`), skipped when the layer cannot run there (with the one line that says why).
* :class:`PropertyCheck` (``property:NAME``): the whole server gate on the build (``gate --backend server
  --source``), present when it reports that property failed, absent when it checked it and it held. Away from the
  pinned commit the model's drift may fail model-based properties: the log's six (``limit``, ``accounting``,
  ``checkpoint_lists``, ``load_choice``, ``alloc_eviction``, ``load_transfer``) are the ones that mean the same
  everywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from harness.backends.llama_server.differential import LIMIT_PROGRAMS, launch_of
from harness.child import run_child
from harness.errors import HarnessError, HarnessLimit, RequestFailed, UsageError
from harness.findings import FINDINGS, Finding
from harness.targets.llama_server import ServerProcess
from harness.targets.server_log import CacheLog
from harness.trees.binding import bind
from harness.trees.build import tree_of_build
from harness.trees.driver import DRIVER_ENV
from harness.trees.tree import cache_root

__all__ = ["ABSENT", "PRESENT", "RUN_SHOWS", "SKIPPED", "Check", "LayerCheck", "ProgramCheck", "PropertyCheck",
           "ReproducerCheck", "Verdict", "check_of", "finding_check", "history_checks", "layer_verdict",
           "property_verdict"]  # fmt: skip

PRESENT = "present"
ABSENT = "absent"
SKIPPED = "skipped"

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Verdict:
    """What one build showed: :data:`PRESENT`, :data:`ABSENT` or :data:`SKIPPED`, and the line that says so."""

    state: str
    why: str


class Check(Protocol):
    """A question put to one build; ``name`` is how ``history`` takes it again on its command line."""

    @property
    def name(self) -> str: ...

    def run(self, binary: Path, log: Callable[[str], None]) -> Verdict: ...


@dataclass(frozen=True)
class ReproducerCheck:
    finding: Finding
    timeout: float = 900.0

    @property
    def name(self) -> str:
        return self.finding.id

    def run(self, binary: Path, log: Callable[[str], None]) -> Verdict:
        assert self.finding.reproducer is not None
        argv = [sys.executable, "-m", "harness.history.reproducer", str(ROOT / self.finding.reproducer), str(binary)]
        res = run_child(argv, timeout=self.timeout)
        said = [ln for ln in (res.stdout + "\n" + res.stderr).splitlines() if ln.strip()]
        last = said[-1].strip()[:300] if said else res.describe()
        if res.status == "exited" and res.returncode == 1:
            return Verdict(PRESENT, last)
        if res.status == "exited" and res.returncode == 0:
            return Verdict(ABSENT, last)
        return Verdict(SKIPPED, f"the reproducer {res.describe()}: {last}")


#: The libllama findings each layer's default run shows on the pinned tree (``gate --backend llama --profile ci``,
#: ``contract``, seed 0): only for these is a run that does not show them an "absent"; the others are shown by their
#: reproducers alone, and a run without them says nothing.
RUN_SHOWS: dict[str, frozenset[str]] = {
    "llama": frozenset({"kv-layout-dependent-logits", "draft-kv-exhaustion (real state)", "graph-compute-segv",
                        "state-io-alloc-outside-try", "decode-bad-alloc-terminates"}),
    "contract": frozenset({"seq-keep-ignores-other-streams", "recurrent-seq-rm-range-silent",
                           "recurrent-seq-cp-ignores-range", "recurrent-seq-rm-any-seq-refused",
                           "seq-add-moves-shared-cells"}),
}  # fmt: skip

_LAYER_RUNS: dict[tuple[str, str], dict[str, Any] | Verdict] = {}  # (binary, layer) -> its JSON, or why it cannot run


@dataclass(frozen=True)
class LayerCheck:
    finding: Finding
    timeout: float = 1800.0

    @property
    def name(self) -> str:
        return self.finding.id

    def run(self, binary: Path, log: Callable[[str], None]) -> Verdict:
        layer = self.finding.backend
        key = (str(binary.resolve()), layer)
        if key not in _LAYER_RUNS:
            _LAYER_RUNS[key] = _run_layer(binary, layer, self.timeout, log)
        data = _LAYER_RUNS[key]
        if isinstance(data, Verdict):
            return data
        return layer_verdict(data, layer, self.finding.id)


def _run_layer(binary: Path, layer: str, timeout: float, log: Callable[[str], None]) -> dict[str, Any] | Verdict:
    """One run of ``layer`` (``llama``: the libllama backend; ``contract``) on the build's libllama, its JSON."""
    tree = tree_of_build(binary.resolve().parent)
    if tree is None:
        return Verdict(SKIPPED, f"{binary} is not a harness build: no tree to bind its libllama from")
    try:
        driver = bind(tree, binary.resolve().parent, log=log)
    except HarnessLimit as e:
        return Verdict(SKIPPED, str(e))
    with tempfile.TemporaryDirectory(prefix="harness-history-") as tmp:
        out = Path(tmp) / "layer.json"
        cmd = ["gate", "--backend", "llama", "--profile", "ci"] if layer == "llama" else ["contract"]
        log(f"running {' '.join(cmd)} on {tree}'s libllama")
        res = run_child([sys.executable, "-m", "harness", *cmd, "--json", str(out)],
                        env={**os.environ, DRIVER_ENV: str(driver)}, timeout=timeout)  # fmt: skip
        try:
            data: dict[str, Any] = json.loads(out.read_text())
        except (OSError, ValueError):
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [res.describe()]
            return Verdict(SKIPPED, f"{' '.join(cmd)} wrote no report ({res.describe()}): {tail[0][:300]}")
    kept = cache_root() / "history" / f"{binary.resolve().parent.name}-{layer}.json"  # the layer's whole report
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps({**data, "exit_code": res.returncode, "tree": str(tree)}, indent=1))
    log(f"{' '.join(cmd)} on {tree}: exit {res.returncode}, its report kept in {kept}")
    return data


def layer_verdict(data: dict[str, Any], layer: str, finding: str) -> Verdict:
    """A layer's JSON on one finding: shown (with its evidence), not shown by a run that shows it on the pinned tree,
    or not told (a finding that run does not show even there)."""
    name = {"llama": "the llama backend", "contract": "the contract machine"}[layer]
    if layer == "contract":
        row = next((f for f in data.get("findings", []) if f.get("name") == finding), None)
        if row is not None:
            return Verdict(PRESENT, f"{name} saw it: {str((row.get('evidence') or [''])[0])[:240]}")
        cond = FINDINGS[finding].condition if finding in FINDINGS else None
        archs = cond.archs if cond is not None else frozenset()
        died = [c["config"] for c in data.get("configs", []) if str(c.get("config", "")).split("_")[0] in archs
                and (c.get("failure") or any(k in FINDINGS and FINDINGS[k].property == "libllama_abort"
                                             for k in c.get("finding_counts", {})))]  # fmt: skip
        if died:
            return Verdict(SKIPPED, f"{name}'s run of {', '.join(died)} ended early (an abort or a failure), before "
                                    "it could show it")  # fmt: skip
        ran = sum(int(n) for per in (data.get("checks") or {}).values() for n in dict(per).values())
    else:
        known = next((k for k in data.get("known_findings", []) if k.get("id") == finding), None)
        if known is not None and known.get("status") == "reproduced":
            return Verdict(PRESENT, f"{name} reproduced it {known.get('count')} times")
        ran = sum(int(r.get("examples", 0)) for r in data.get("properties", []))
    if finding not in RUN_SHOWS[layer]:
        return Verdict(SKIPPED, f"{name}'s run does not show it, not even on the pinned tree (its reproducer does)")
    if not ran:
        return Verdict(SKIPPED, f"{name} checked nothing on this build")
    return Verdict(ABSENT, f"{name} ran ({ran} checks) and did not show it, as it does on the pinned tree")


@dataclass(frozen=True)
class ProgramCheck:
    program: str
    prop: str | None = None

    @property
    def name(self) -> str:
        return f"program:{self.program}" + (f":{self.prop}" if self.prop else "")

    def run(self, binary: Path, log: Callable[[str], None]) -> Verdict:
        cfg, requests = LIMIT_PROGRAMS[self.program]()
        cfg = dataclasses.replace(cfg, log_verbosity=4)  # the cache's own trace lines
        cache_log = CacheLog(cfg.ctx_checkpoints)
        with tempfile.TemporaryDirectory(prefix="harness-history-") as tmp:
            server = ServerProcess(binary, launch_of(cfg), log_path=str(Path(tmp) / "server.log"))
            try:
                try:
                    server.start()
                except HarnessError as e:
                    return Verdict(SKIPPED, f"the program's llama-server did not start: {e}")
                for i, (toks, n) in enumerate(requests, 1):
                    try:
                        server.completion(list(toks), n, ignore_eos=True)
                    except RequestFailed as e:
                        crash = self.prop in (None, "server_crash") and not e.alive
                        return Verdict(PRESENT if crash else SKIPPED, f"request {i} of {len(requests)}: {e.describe()}")
                    for p in cache_log.feed(server.log_through(i)):
                        if self.prop is None or p.property == self.prop:
                            return Verdict(PRESENT, f"request {i} of {len(requests)}: {p.property}: {p.message}")
            finally:
                server.stop()
        checked = ", ".join(f"{k} {v}" for k, v in sorted(cache_log.checked.items()))
        if self.prop is not None and not cache_log.checked.get(self.prop):
            return Verdict(SKIPPED, f"{self.prop} was never checked by this program on this build ({checked})")
        return Verdict(ABSENT, f"{len(requests)} requests, the log's properties held ({checked})")


@dataclass(frozen=True)
class PropertyCheck:
    prop: str
    timeout: float = 3600.0

    @property
    def name(self) -> str:
        return f"property:{self.prop}"

    def run(self, binary: Path, log: Callable[[str], None]) -> Verdict:
        with tempfile.TemporaryDirectory(prefix="harness-history-") as tmp:
            out = Path(tmp) / "gate.json"
            argv = [sys.executable, "-m", "harness", "gate", "--backend", "server", "--server-bin", str(binary),
                    "--semantics", "master", "--json", str(out)]  # fmt: skip
            res = run_child(argv, timeout=self.timeout)
            try:
                data = json.loads(out.read_text())
            except (OSError, ValueError):
                tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [res.describe()]
                return Verdict(SKIPPED, f"the gate wrote no report ({res.describe()}): {tail[0][:300]}")
        return property_verdict(data, self.prop)


def property_verdict(data: dict[str, Any], prop: str) -> Verdict:
    """A gate's JSON on one property: failed (a failure filed under it, with its message), held (checked, none
    failed) or not checked on this build (a skip)."""
    failed = [f for f in data.get("failures", []) if f.get("property") == prop]
    if failed:
        return Verdict(PRESENT, f"the gate failed {prop}: {str(failed[0].get('message', ''))[:300]}")
    row: dict[str, Any] = next((r for r in data.get("properties", []) if r.get("name") == prop), {})
    if row.get("examples", 0) > 0:
        return Verdict(ABSENT, f"the gate checked {prop} {row['examples']} times; it held")
    return Verdict(SKIPPED, f"the gate did not check {prop} on this build")


def finding_check(f: Finding) -> ReproducerCheck | LayerCheck | None:
    """How ``history`` asks a build about a finding: its reproducer when it takes a binary, the layer that shows it
    for a libllama finding; None when no build but the pinned one can be asked."""
    if f.takes_binary and f.reproducer is not None:
        return ReproducerCheck(f)
    if f.backend in ("llama", "contract"):
        return LayerCheck(f)
    return None


def history_checks() -> list[Finding]:
    """The registered findings ``history`` can test on any build."""
    return [f for f in FINDINGS.values() if finding_check(f) is not None]


def check_of(text: str) -> Check:
    """``FINDING`` (a finding's id), ``program:NAME[:PROPERTY]`` or ``property:NAME``; one line if it is none."""
    kind, _, rest = text.partition(":")
    if kind == "program" and rest:
        name, _, prop = rest.partition(":")
        if name not in LIMIT_PROGRAMS:
            raise UsageError(f"history {text}: the programs are {', '.join(LIMIT_PROGRAMS)}")
        return ProgramCheck(name, prop or None)
    if kind == "property" and rest:
        return PropertyCheck(rest)
    f = FINDINGS.get(text)
    if f is None:
        raise UsageError(f"history {text}: not a finding's id, program:NAME or property:NAME "
                         f"(findings it can test: {', '.join(x.id for x in history_checks())})")  # fmt: skip
    check = finding_check(f)
    if check is None:
        raise UsageError(f"history {text}: its reproducer takes no llama-server binary and no layer shows it, so "
                         f"no build but the pinned one can ask it (findings it can test: "
                         f"{', '.join(x.id for x in history_checks())})")  # fmt: skip
    return check

