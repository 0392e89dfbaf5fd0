"""Slot files on a real ``llama-server`` against the model (issue #39, point 3): ``python -m harness slot-files
--differential``.

:class:`SlotDifferential` is the server backend's :class:`~harness.backends.llama_server.differential.Differential`
(one server, -np 1, ``--cache-ram 0`` so that only the slot and its file move state; the reference model on libllama
contexts of the same model) with ``--slot-save-path`` and a :class:`~harness.model.slot_files.SlotFileStore` beside
the model (also with ``--cache-ram 8``): every save, restore and erase goes to both (the model's
:func:`~harness.model.slot_files.slot_save` and kin). Per round of :func:`run_differential` on each model: a prompt A
(answered), save, an unrelated prompt B, restore, then a prompt that diverges from A before its end (Q), erase,
restore, and a prompt that extends the whole restored slot. After every restore the next completion's
``timings.cache_n`` is compared with the model's prediction and its output with a fresh evaluation
(:func:`~harness.backends.llama_server.differential.check_output`: a server with ``cache_prompt`` off; a near tie is
the known ``greedy-flip-on-cache-path``). A control server that never saved gets A then Q: its ``cache_n`` minus the
restored slot's is what the file lost (the checkpoints it does not hold: registered finding
``slot-restore-drops-checkpoints``), counted as ``tokens_reprocessed``.

:func:`enospc` puts ``--slot-save-path`` on a 64 KiB tmpfs (mounted here, root only; always unmounted), filled so
that a save runs out of space mid-file, twice: with a free space that fails an ``fwrite`` (answer 500, the bytes
written are left: ``slot-save-partial-file``) and with only the buffered tail missing (answer 200, a short file:
``slot-save-silent-truncation``); each file is then restored (the server aborts: ``slot-restore-truncated-file-abort``).

:func:`stale_draft`: with a draft model, a restore onto a slot that held another prompt, then a completion (HTTP 500
while ``slot-restore-stale-draft`` stands: the file has no draft state and restore leaves the draft context as it
was); after an erase the same restore works.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fixtures.gguf import draft_path, model_path
from harness.backends.llama_server.differential import Differential, check_output
from harness.errors import RequestFailed
from harness.experiments.full_disk import free_bytes, tmpfs
from harness.interrupt import check
from harness.model.slot_files import SlotFileStore, slot_erase, slot_restore, slot_save
from harness.targets.llama_server import Launch, ServerConfig, ServerProcess

__all__ = ["ARCHS", "SlotDifferential", "enospc", "run_differential", "stale_draft"]

ARCHS = ("llama", "jamba", "mamba")
FILE = "a.bin"


class SlotDifferential(Differential):
    """A :class:`Differential` whose server has ``--slot-save-path`` and whose model has a file store."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.save_dir = tempfile.mkdtemp(prefix="slot-restore-")
        self.server.args += ["--slot-save-path", self.save_dir + "/"]
        self.store = SlotFileStore(checkpoints=self.model.params.slot_file_checkpoints)

    def close(self) -> None:
        try:
            super().close()
        finally:
            shutil.rmtree(self.save_dir, ignore_errors=True)

    def act(self, action: str, filename: str = FILE) -> tuple[tuple[int, int], tuple[int, int]]:
        """One slot action on the server and the model, any status: ((status, tokens) of the server, of the model);
        a deferred model action is (-1, -1)."""
        body = {} if action == "erase" else {"filename": filename}
        key = {"save": "n_saved", "restore": "n_restored", "erase": "n_erased"}[action]
        try:
            got = (200, int(self.server.request("POST", f"/slots/0?action={action}", body)[key]))
        except RequestFailed as e:
            if e.kind != "http" or e.status is None:
                raise
            got = (e.status, 0)
        if action == "save":
            m = slot_save(self.model, 0, filename, self.store)
        elif action == "restore":
            m = slot_restore(self.model, 0, filename, self.store)
        else:
            m = slot_erase(self.model, 0)
        return got, ((m.status, m.n_tokens if m.ok else 0) if m else (-1, -1))

    def action(self, action: str) -> tuple[int, int]:
        """One slot action on the server and the model: (the server's token count, the model's)."""
        body = {} if action == "erase" else {"filename": FILE}
        r = self.server.request("POST", f"/slots/0?action={action}", body)
        if action == "save":
            m = slot_save(self.model, 0, FILE, self.store)
            return int(r["n_saved"]), m.n_tokens if m else -1
        if action == "restore":
            m = slot_restore(self.model, 0, FILE, self.store)
            return int(r["n_restored"]), m.n_tokens if m else -1
        m = slot_erase(self.model, 0)
        return int(r["n_erased"]), m.n_tokens if m else -1


@dataclass
class Figures:
    arch: str
    cache_ram: int = 0  # --cache-ram MiB
    restores: int = 0
    actions_matched: int = 0
    actions: int = 0
    compared: int = 0
    outputs_equal: int = 0
    near_ties: int = 0
    cache_n_matched: int = 0
    tokens_reprocessed: int = 0  # the control's cache_n minus the restored slot's, on the diverging prompts
    mismatches: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [1, *(rng.randrange(2, 200) for _ in range(n - 1))]


def _one_round(arch: str, binary: Path, fresh: ServerProcess, seed: int, fig: Figures) -> None:
    rng = random.Random(seed)
    a, b = _prompt(rng, 100), _prompt(rng, 60)
    q = a[:80] + [rng.randrange(2, 200) for _ in range(8)]
    cfg = ServerConfig(arch, n_parallel=1, cache_ram_mib=fig.cache_ram)
    d = SlotDifferential(cfg, binary)
    with d, Differential(cfg, binary) as control:
        control.request(a, 4)
        want = control.request(q, 4).cache_n
        row_a = d.request(a, 4)
        steps: list[tuple[str, list[int] | None]] = [
            ("save", None), ("req", b), ("restore", None), ("req", q), ("erase", None), ("restore", None),
            ("req", [*a, *row_a.generated[:3], 7, 8, 9]),
        ]  # fmt: skip
        restored = False
        for what, toks in steps:
            check()
            if toks is None:
                got, pred = d.action(what)
                fig.actions += 1
                fig.actions_matched += got == pred
                if got != pred:
                    fig.mismatches.append(f"{arch} seed {seed} {what}: server {got} tokens, model {pred}")
                if what == "restore":
                    fig.restores += 1
                    restored = True
                continue
            row = d.request(toks, 4)
            if not restored:
                continue
            restored = False
            fig.cache_n_matched += row.ok
            if not row.ok:
                fig.mismatches.append(f"{arch} seed {seed}: {row.describe()}")
            out = check_output(fresh, row)
            fig.compared += 1
            fig.outputs_equal += out is None
            fig.near_ties += out == "near-tie"
            if out not in (None, "near-tie"):
                fig.mismatches.append(f"{arch} seed {seed}: {out}")
            if toks is q:
                fig.tokens_reprocessed += max(0, want - row.cache_n)


def run_differential(
    binary: Path, archs: tuple[str, ...] = ARCHS, rounds: int = 1, seed: int = 0, cache_ram: tuple[int, ...] = (0, 8)
) -> dict[str, Any]:
    """Every round on every model, with each ``--cache-ram`` (0: the slot alone; 8 MiB: the RAM cache beside it,
    which holds A with its checkpoints once B displaced it, and which the restored slot, sharing 80 of Q's 88
    tokens, never consults); the figures per model and cache, and their sums."""
    figs = []
    for arch in archs:
        with ServerProcess(
            binary,
            Launch(model=model_path(arch), n_parallel=1, ctx_size=2048, cache_ram=0, args=["--no-warmup"]),
        ) as fresh:  # fmt: skip
            for mib in cache_ram:
                fig = Figures(arch, mib)
                for r in range(rounds):
                    _one_round(arch, binary, fresh, seed + r, fig)
                figs.append(fig)
    keys = ("restores", "actions", "actions_matched", "compared", "outputs_equal", "near_ties", "cache_n_matched",
            "tokens_reprocessed")  # fmt: skip
    total = {k: sum(getattr(f, k) for f in figs) for k in keys}
    return {"models": [f.to_json() for f in figs], "total": total,
            "mismatches": [m for f in figs for m in f.mismatches]}  # fmt: skip


def stale_draft(binary: Path, arch: str = "llama") -> dict[str, Any]:
    """A restore onto a speculative slot that held another prompt, then a completion extending the restored one:
    its status (500 while ``slot-restore-stale-draft`` stands) and, after an erase and the same restore, again."""
    rng = random.Random(0)
    a, b = _prompt(rng, 60), _prompt(rng, 30)
    out: dict[str, Any] = {"arch": arch}
    with tempfile.TemporaryDirectory() as save, ServerProcess(
        binary,
        Launch(
            model=model_path(arch),
            draft=draft_path(),
            n_parallel=1,
            ctx_size=512,
            cache_ram=0,
            args=["--slot-save-path", save + "/", "--no-warmup"],
        ),
    ) as srv:  # fmt: skip
        gen = srv.completion(a, 16, ignore_eos=True, return_tokens=True)["tokens"]
        srv.request("POST", "/slots/0?action=save", {"filename": FILE})
        srv.completion(b, 16, ignore_eos=True)
        for label in ("after_other_prompt", "after_erase"):
            check()
            if label == "after_erase":
                srv.request("POST", "/slots/0?action=erase", {})
            srv.request("POST", "/slots/0?action=restore", {"filename": FILE})
            try:
                r = srv.completion([*a, *gen[:15], 5, 6, 7], 16, ignore_eos=True)
                out[label] = {"status": 200, "cache_n": int(r["timings"]["cache_n"])}
            except RequestFailed as e:
                out[label] = {"status": e.status, "message": e.message}
    return out


def enospc(binary: Path, arch: str = "llama") -> dict[str, Any]:
    """A save into a full 64 KiB tmpfs, with a fwrite that fails and with only the buffered tail lost."""
    prompt = _prompt(random.Random(0), 61)
    cases: list[dict[str, Any]] = []
    with tmpfs("64k", prefix="slot-enospc-") as base:
        size = 0
        for label in ("probe", "fwrite-fails", "tail-lost"):
            check()
            for p in base.iterdir():
                p.unlink()
            page = 4096
            free = {"probe": free_bytes(base), "fwrite-fails": 2 * page, "tail-lost": size // page * page}[label]
            (base / "filler").write_bytes(b"\0" * max(0, free_bytes(base) - free))
            with ServerProcess(
                binary,
                Launch(
                    model=model_path(arch),
                    n_parallel=1,
                    ctx_size=256,
                    cache_ram=0,
                    args=["--slot-save-path", str(base) + "/", "--no-warmup"],
                ),
            ) as srv:  # fmt: skip
                srv.completion(prompt, 4)
                row: dict[str, Any] = {"case": label, "free": free}
                try:
                    r = srv.request("POST", "/slots/0?action=save", {"filename": FILE})
                    row |= {"save_status": 200, "n_written": int(r["n_written"])}
                except RequestFailed as e:
                    row |= {"save_status": e.status, "save_error": e.message}
                f = base / FILE
                row["file_bytes"] = f.stat().st_size if f.exists() else None
                if label == "probe":
                    size = int(row.get("n_written", 0))
                    continue
                # the model's answer for a save of this size meeting ENOSPC after the free bytes
                row["predicted_status"] = 500 if SlotFileStore().write_failed(size, free) else 200
                try:
                    srv.request("POST", "/slots/0?action=restore", {"filename": FILE})
                    row["restore"] = "200"
                except RequestFailed as e:
                    row["restore"] = "server died" if not e.alive else f"{e.status} {e.message}"
                row["server_exit"] = srv.proc.poll() if srv.proc is not None else None
                cases.append(row)
    return {"arch": arch, "file_size": size, "cases": cases}
