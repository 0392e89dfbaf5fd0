"""Generated slot-file programs on a real ``llama-server`` against the model and a fresh evaluation (issue #39,
point 3): ``python -m harness slot-files --differential --examples N --seed S``.

An example is a program of up to :data:`MAX_STEPS` steps on one server (``-np 1``, ``--cache-ram 0``,
``--slot-save-path``) and the reference model on libllama contexts of the same model
(:class:`~harness.experiments.slot_restore.SlotDifferential`): completions whose prompts take a part
(in 24ths) of an earlier prompt or of a conversation the slot held (its prompt and the tokens generated) and
add new tokens, and ``save``, ``restore`` and ``erase`` on three file names (the third never saved: a restore of
it is a 400 that clears the slot). Checked at each step, and failing on any difference no registered finding
explains by its exact condition:

* every action's HTTP status and token count (``n_saved``/``n_restored``/``n_erased``) are the model's
  (:mod:`harness.model.slot_files`; a restore's is ``slot_file_restore``, the others ``slot_action``);
* every completion's slot and ``timings.cache_n`` are the model's (``Row.ok``) and the reuse property holds
  (``Row.reuse_problem``; a shortfall the model's tracer names is counted under that finding);
* after every restore, the next completion's slot and ``cache_n`` are the model's and its tokens are a fresh
  cache-less server's (:func:`~harness.load.generated.output_verdict`): ``slot_file_restore``; a greedy flip
  within the model's batch-shape bound is ``greedy-flip-on-cache-path`` (counted; none excused on mamba), anything
  else fails;
* the same completion is also resumed as if the file had kept the checkpoints the slot had when it was saved
  (:func:`properties.reuse.resume_point` on the saved tokens, checkpoints and ``seq_pos_min``): when the server
  matched the model and resumed fewer tokens, that is ``slot-restore-drops-checkpoints`` (counted, with the
  tokens reprocessed).

A failure is shrunk (:func:`harness.load.generated.run_generated`) and printed as the
concrete program (:func:`replay`), the seed and the command line. :data:`MUTANTS` plants a bug for the tests:
``keep-checkpoints`` (the model's restore keeps the slot's checkpoints, as PR #27451's appendix would) and
``corrupt-file`` (a server-side difference without a build: every slot file's last state bytes zeroed after
its save, before the server reads it back).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from fixtures.gguf import model_path
from harness.experiments.slot_restore import SlotDifferential
from harness.findings import SLOT_RESTORE_DROPS_CHECKPOINTS
from harness.interrupt import check
from harness.load.generated import GeneratedFailure, GeneratedFigures, failed_request, output_verdict, run_generated
from harness.model.server_context import ServerSlot
from harness.model.slot_files import SlotFileStore
from harness.targets.llama_server import Launch, RequestFailed, ServerConfig, ServerProcess
from properties.reuse import Ckpt, Source, resume_point

__all__ = ["ARCHS", "MUTANTS", "ModelFigures", "command_line", "program_strategy", "replay", "replay_text", "run_model"]

ARCHS = ("llama", "gemma2", "jamba", "mamba", "lfm2")
NAMES = ("a.bin", "b.bin", "never.bin")
MAX_STEPS = 10
DROPS = SLOT_RESTORE_DROPS_CHECKPOINTS.id

# abstract steps: ("req", source, keep, n_new, seed, n_predict) | ("save", name) | ("restore", name) | ("erase",)
_REQ = st.tuples(st.just("req"), st.integers(0, 7), st.integers(0, 24), st.sampled_from([1, 8, 40, 100]),
                 st.integers(0, 255), st.integers(1, 4))  # fmt: skip
# a segment: what comes first (by a number 0-9: 0-1 save, 2-6 restore, 7 erase, 8-9 a completion), the file
# (0-6: a.bin, 7-8: b.bin, 9: never saved; a save of it is b.bin's) and, unless the flag is 0-1 of 0-9, a
# completion after it
_SEGMENT = st.tuples(st.integers(0, 9), st.integers(0, 9), _REQ, st.integers(0, 9), _REQ)


def _flatten(segments: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = [("req", 0, 0, 100, 0, 4), ("save", 0)]
    for kind, name, req, then, req2 in segments:
        f = 0 if name < 7 else 1 if name < 9 else 2
        out.append(("save", min(f, 1)) if kind < 2 else ("restore", f) if kind < 7 else ("erase",) if kind < 8
                   else req)  # fmt: skip
        if then >= 2:
            out.append(req2)
    return out[:MAX_STEPS]


def program_strategy() -> st.SearchStrategy[list[tuple[Any, ...]]]:
    """A program: a first completion of 100 new tokens and its save to ``a.bin``, then segments (an action or a
    completion, mostly followed by a completion), ``MAX_STEPS`` steps at most."""
    return st.lists(_SEGMENT, min_size=2, max_size=MAX_STEPS // 2).map(_flatten)


class _KeepCheckpoints(SlotFileStore):
    """Mutant: the model's restore keeps the checkpoints the slot had (upstream drops them, :2618)."""

    def restore_prompt(self, slot: ServerSlot, tokens: tuple[int, ...]) -> None:
        if slot.prompt.tokens[: len(tokens)] != tokens:
            super().restore_prompt(slot, tokens)
        else:  # the slot still holds the file's prompt: set the tokens without clear(), the checkpoints stay
            slot.prompt.tokens = tokens


MUTANTS = ("keep-checkpoints", "corrupt-file")


@dataclass
class ModelFigures(GeneratedFigures):
    """One model's generated run."""

    arch: str
    examples: int = 0
    requests: int = 0
    actions: int = 0
    restores: int = 0  # restores the server answered 200
    compared: int = 0  # outputs compared with a fresh evaluation (the first completion after each restore)
    restore_checks: int = 0  # restores held to slot_file_restore: the action's answer, and the completion after it
    outputs_equal: int = 0
    findings: Counter[str] = field(default_factory=Counter)  # per registered finding: differences it explains
    tokens_reprocessed: int = 0  # slot-restore-drops-checkpoints: tokens the dropped checkpoints would have kept
    failure: GeneratedFailure | None = None
    seed: int = 0


def _prompt(bases: Sequence[tuple[int, ...]], source: int, keep: int, n_new: int, seed: int) -> tuple[int, ...]:
    base = bases[source % len(bases)] if bases else ()
    new = tuple(3 + (seed * 31 + i * 17) % 250 for i in range(n_new))
    return ((base[: len(base) * keep // 24] + new) or (1,))[-1000:]


def _config(arch: str) -> ServerConfig:
    return ServerConfig(arch, n_parallel=1, cache_ram_mib=0)


def _corrupt(path: Path) -> None:
    """Zero an eighth of a slot file from its middle (inside the state's tensor data), in place."""
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.seek(size // 2)
        f.write(b"\0" * (size // 8))


class _Run:
    """One program on one server and model: each step run, checked and written down as a replay line."""

    def __init__(self, d: SlotDifferential, fresh: ServerProcess, fig: ModelFigures, mutant: str | None,
                 binary_expr: str = "build_server('shared')") -> None:  # fmt: skip
        self.d, self.fresh, self.fig, self.mutant = d, fresh, fig, mutant
        self.binary_expr = binary_expr  # the replay program's expression for the server's binary
        self.lines: list[str] = []
        self.bases: list[tuple[int, ...]] = []
        self.saved: dict[str, Source] = {}  # file name -> what the slot held when it was saved
        self.restored: Source | None = None  # the restored file's source, until the next completion

    def fail(self, name: str, message: str) -> None:
        raise GeneratedFailure(name, message, replay_text(self.fig.arch, self.lines, self.mutant, self.binary_expr))

    def slot_source(self) -> Source:
        m = self.d.model
        slot = m.slots[0]
        cps = tuple(Ckpt(c.n_tokens, c.pos_min, c.pos_max) for c in slot.prompt.checkpoints)
        return Source(slot.prompt.tokens, cps, m.ctx_tgt.memory_seq_pos_min(0))

    def step(self, s: tuple[Any, ...]) -> None:
        check()
        if s[0] == "req":
            toks = _prompt(self.bases, *s[1:5])
            self.lines.append(f"    r.request({list(toks)!r}, {s[5]})")
            self.request(toks, s[5])
            return
        name = NAMES[s[1]] if len(s) > 1 else ""
        self.lines.append(f"    r.action({s[0]!r}, {name!r})")
        self.action(s[0], name)

    def action(self, what: str, name: str) -> None:
        """One slot action, checked; one that got no usable answer is a failure with the program so far."""
        try:
            self._action(what, name)
        except RequestFailed as e:
            self.fail(failed_request(e), f"{what} {name!r}: {e.describe()}")

    def _action(self, what: str, name: str) -> None:
        before = self.slot_source()
        got, want = self.d.act(what, name)
        self.fig.actions += 1
        if got != want:  # a restore's answer is the slot_file_restore property's first half; the others are actions
            self.fail("slot_file_restore" if what == "restore" else "slot_action",
                      f"{what} {name!r}: server (status, tokens) {got}, model {want}")  # fmt: skip
        if what == "save" and got[0] == 200:
            self.saved[name] = before
            if self.mutant == "corrupt-file":
                _corrupt(Path(self.d.save_dir, name))
        elif what == "restore" and got[0] == 200:
            self.fig.restores += 1
            self.fig.restore_checks += 1
            self.restored = self.saved.get(name)
        else:
            self.restored = None

    def request(self, toks: tuple[int, ...], n_predict: int) -> None:
        """One completion, checked; one that got no usable answer (from the server or the fresh one) is a failure
        with the program so far."""
        try:
            self._request(toks, n_predict)
        except RequestFailed as e:
            self.fail(failed_request(e), f"a prompt of {len(toks)} tokens: {e.describe()}")

    def _request(self, toks: tuple[int, ...], n_predict: int) -> None:
        restored, self.restored = self.restored, None
        row = self.d.request(toks, n_predict)
        self.fig.requests += 1
        self.bases += [toks, (*toks, *row.generated[:-1])]
        if not row.ok:  # right after a restore: what the slot holds is the file's (slot_file_restore's second half)
            self.fail("cache_n" if restored is None else "slot_file_restore",
                      row.describe() + ("" if restored is None else " (the first completion after a restore)"))
        if row.reuse_finding is not None and row.cache_n < row.best_usable:
            self.fig.findings[row.reuse_finding] += 1
        elif (problem := row.reuse_problem()) is not None:
            self.fail("reuse", problem)
        if restored is None:
            return
        kept = resume_point(restored, toks, self.d.model.n_swa)
        if kept > row.cache_n:  # the server did what the model does: the checkpoints the file lacks
            self.fig.findings[DROPS] += 1
            self.fig.tokens_reprocessed += kept - row.cache_n
        found, problem = output_verdict(self.fresh, toks, row.generated, row.cache_n, self.fig.arch)
        self.fig.compared += 1
        if problem is not None:
            self.fail("slot_file_restore", f"after a restore: {problem}")
        if found:
            self.fig.findings[found] += 1
        else:
            self.fig.outputs_equal += 1


def replay_text(arch: str, lines: Sequence[str], mutant: str | None = None,
                binary_expr: str = "build_server('shared')") -> str:  # fmt: skip
    """The concrete program as Python to paste from the repository root."""
    head = ["from pathlib import Path",
            "from harness.trees.build import build_server",
            "from harness.load.slot_programs import replay",
            f"with replay({arch!r}, {binary_expr}{'' if mutant is None else f', mutant={mutant!r}'}) as r:"]
    return "\n".join([*head, *(lines or ["    pass"])])


class replay:
    """The replay programs' runner: one server, model and fresh server; ``request``/``action`` check a step
    as the generated run did and raise :class:`GeneratedFailure` on a difference."""

    def __init__(self, arch: str, binary: Path, mutant: str | None = None) -> None:
        self.arch, self.binary, self.mutant = arch, binary, mutant
        self.fig = ModelFigures(arch)

    def __enter__(self) -> replay:
        self.fresh = _fresh(self.arch, self.binary)
        self.fresh.start()
        try:
            self.d = _slot_differential(self.arch, self.binary, self.mutant)
            self.d.__enter__()
        except BaseException:
            self.fresh.stop()
            raise
        self.run = _Run(self.d, self.fresh, self.fig, self.mutant, f"Path({str(self.binary)!r})")
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.d.close()
        finally:
            self.fresh.stop()

    def request(self, tokens: Sequence[int], n_predict: int) -> None:
        self.run.request(tuple(tokens), n_predict)

    def action(self, what: str, name: str) -> None:
        self.run.action(what, name)


def _fresh(arch: str, binary: Path) -> ServerProcess:
    cfg = _config(arch)
    return ServerProcess(
        binary,
        Launch(
            model=model_path(arch),
            n_parallel=1,
            ctx_size=cfg.n_ctx,
            cache_ram=0,
            ctx_checkpoints=cfg.ctx_checkpoints,
            args=cfg.server_args(),
        ),
    )


def _slot_differential(arch: str, binary: Path, mutant: str | None) -> SlotDifferential:
    d = SlotDifferential(_config(arch), binary)
    if mutant == "keep-checkpoints":
        d.store = _KeepCheckpoints()
    return d


def run_model(
    arch: str, binary: Path, *, examples: int, seed: int, mutant: str | None = None, shrinks: int | None = 15,
    binary_expr: str = "build_server('shared')",
) -> ModelFigures:
    """``examples`` generated programs on ``arch`` (see the module's docstring); the figures and the shrunk
    failure, if any (its program names the server's binary as ``binary_expr``)."""
    if mutant is not None and mutant not in MUTANTS:
        raise ValueError(f"unknown slot-program mutant {mutant!r}")
    fig = ModelFigures(arch, seed=seed)
    with _fresh(arch, binary) as fresh:

        def run_one(program: list[tuple[Any, ...]]) -> None:
            d = _slot_differential(arch, binary, mutant)
            with d:
                run = _Run(d, fresh, fig, mutant, binary_expr)
                for s in program:
                    run.step(s)

        out = run_generated(program_strategy(), run_one, examples=examples, seed_value=seed, shrinks=shrinks)
    fig.examples, fig.failure = out.examples, out.failure
    return fig


def command_line(archs: Sequence[str], examples: int, seed: int) -> str:
    return (f"python -m harness slot-files --differential --models {','.join(archs)} --examples {examples} "
            f"--seed {seed}")  # fmt: skip

