"""A slot save at every free-space boundary of a full disk: ``no_partial_file`` on a real ``llama-server``.

:func:`full_disk` starts one server (``-np 1``, ``--cache-ram 0``, ``--slot-save-path`` on a 64 KiB tmpfs mounted
here: root only, always unmounted), fills its slot with a 61-token prompt, saves it once on the empty disk (the
file's size ``S``, which must land whole), then saves it again with the disk filled so that exactly ``k`` pages are
free, for every ``k`` from 0 to one page past ``S``: each boundary where the save's last bytes, the stdio buffer
(``STDIO_BUFSIZ``) or a whole ``fwrite`` meet ``ENOSPC``. After each save the file on disk is held to
``no_partial_file``: whole (``S`` bytes, or absent after a failed save), or partial in the exact shape of one of the
two registered upstream findings (:func:`properties.slot_file_machine.partial_shape`: ``slot-save-partial-file``, a
save answering 500 that leaves its bytes; ``slot-save-silent-truncation``, a save answering 200 that lost at most
the buffered tail at the unchecked ``fclose``), counted, not failed (failed with ``strict``).

The save path as upstream writes it (llama.cpp 0c1e570): ``tools/server/server-context.cpp:2555-2561``
(``llama_state_seq_save_file``), ``src/llama-context.cpp:3377-3395`` (``state_seq_save_file``),
``src/llama-mmap.cpp:358-366`` (``write_raw`` throws on a short ``fwrite``) and ``:377-383`` (``fclose`` unchecked).
The model's prediction of each save's answer (:meth:`~harness.model.slot_files.SlotFileStore.write_failed`) is kept
beside each row (``model_status``), not judged: a tree that fixes the findings may answer 500 where the model says
200, and leave no file; that is no partial file.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fixtures.gguf import model_path
from harness.errors import RequestFailed, Unavailable
from harness.interrupt import check
from harness.model.slot_files import STDIO_BUFSIZ, SlotFileStore
from harness.targets.llama_server import Launch, ServerProcess
from properties.slot_file_machine import partial_shape

__all__ = ["PAGE", "FullDisk", "SaveRow", "free_bytes", "full_disk", "full_disk_program", "tmpfs"]

PAGE = 4096  # tmpfs allocates whole pages: a filler of k pages leaves exactly the rest free
FILE = "a.bin"
PROMPT_TOKENS = 61  # 64 tokens in the slot after 4 generated (one not yet in the KV): a 17,548-byte file on llama


@contextmanager
def tmpfs(size: str, prefix: str = "slot-disk-") -> Iterator[Path]:
    """A fresh directory with a tmpfs of ``size`` mounted on it, unmounted and removed on every exit."""
    if os.geteuid() != 0:
        raise Unavailable("the full-disk case mounts a tmpfs: run as root")
    base = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(base)], capture_output=True,
                           text=True, check=False)  # fmt: skip
        if r.returncode != 0:
            raise Unavailable(f"mount -t tmpfs failed: {r.stderr.strip()[:200]}")
        try:
            yield base
        finally:
            subprocess.run(["umount", str(base)], check=False, capture_output=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill(base: Path, free: int) -> None:
    """Empty ``base``, then write a filler that leaves exactly ``free`` bytes (a multiple of :data:`PAGE`)."""
    for p in base.iterdir():
        p.unlink()
    (base / "filler").write_bytes(b"\0" * max(0, free_bytes(base) - free))


@dataclass
class SaveRow:
    """One save: the bytes free before it, its answer, the file it left, and the finding its shape is (if any)."""

    free: int
    status: int | None  # None: no answer (the server died or hung on the save, ``FullDisk.died``)
    n_written: int | None
    file_bytes: int | None  # None: no file
    model_status: int  # what the model predicts the save answers (kept, not judged)
    shape: str | None = None  # a partial file's registered finding

    def describe(self, size: int) -> str:
        left = "no file" if self.file_bytes is None else f"{self.file_bytes} of {size} bytes on disk"
        said = {200: f"answered 200, n_written {self.n_written}", None: "got no answer"}.get(
            self.status, f"answered {self.status}"
        )
        return f"a save of {size} bytes with {self.free} bytes free {said}: {left}"


@dataclass
class FullDisk:
    arch: str
    file_size: int = 0
    rows: list[SaveRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    findings: Counter[str] = field(default_factory=Counter)
    died: RequestFailed | None = None  # the save the server died (or hung) on: the run ends there

    @property
    def checked(self) -> int:
        return len(self.rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "arch": self.arch,
            "file_size": self.file_size,
            "saves": [vars(r) for r in self.rows],
            "problems": self.problems,
            "findings": dict(self.findings),
            "died": None if self.died is None else self.died.describe(),
        }


def _save(srv: ServerProcess, base: Path, free: int, size: int) -> tuple[SaveRow, RequestFailed | None]:
    """One save and the file it left; with the failed request when the server died or hung on it."""
    died = None
    status: int | None
    try:
        r = srv.request("POST", "/slots/0?action=save", {"filename": FILE})
        status, n_written = 200, int(r["n_written"])
    except RequestFailed as e:
        if not e.alive or e.status is None:
            died = e
        status, n_written = e.status if died is None else None, None
    f = base / FILE
    model = 500 if SlotFileStore().write_failed(size, free) else 200
    return SaveRow(free, status, n_written, f.stat().st_size if f.exists() else None, model), died


def full_disk(binary: Path, arch: str = "llama", *, strict: bool = False, log_dir: str | None = None) -> FullDisk:
    """Save one slot at every page of free space from none to one page past the file's size (see the module)."""
    prompt = [1, *(random.Random(0).randrange(2, 200) for _ in range(PROMPT_TOKENS - 1))]
    out = FullDisk(arch)
    log = None if log_dir is None else Path(log_dir) / f"full-disk-{arch}.log"
    with tmpfs("64k") as base, ServerProcess(
        binary,
        Launch(model=model_path(arch), n_parallel=1, ctx_size=256, cache_ram=0,
               args=["--slot-save-path", str(base) + "/", "--no-warmup"]),
        log_path=log,
    ) as srv:  # fmt: skip
        srv.completion(prompt, 4, ignore_eos=True)
        _fill(base, free_bytes(base))
        first, died = _save(srv, base, free_bytes(base), 0)
        if died is not None:
            raise died  # on an empty disk: the caller's server_crash or hang
        if first.status != 200 or first.n_written is None:
            raise Unavailable(f"a slot save on an empty 64 KiB disk answered {first.status}: nothing to measure")
        size = out.file_size = first.n_written
        if first.file_bytes != size:
            out.problems.append(f"on an empty disk: {first.describe(size)}")
        for k in range(-(-size // PAGE) + 2):
            check()
            _fill(base, k * PAGE)
            row, out.died = _save(srv, base, k * PAGE, size)
            out.rows.append(row)
            if row.file_bytes is not None and row.file_bytes != size:
                _judge(out, row, size, strict)
            if out.died is not None:
                break  # the server is gone: what its save left was judged above
    return out


def _judge(out: FullDisk, row: SaveRow, size: int, strict: bool) -> None:
    """A partial file: counted as the registered finding whose exact shape it has, else a problem."""
    assert row.file_bytes is not None
    row.shape = partial_shape(size, row.file_bytes, row.status, row.free < size, STDIO_BUFSIZ)
    if row.shape is not None and not strict:
        out.findings[row.shape] += 1
    else:
        out.problems.append(row.describe(size))


def full_disk_program(binary_expr: str, arch: str = "llama") -> str:
    """The full-disk run as a program to paste into ``python`` (repository root, as root): exit 1 on a partial file."""
    return "\n".join([
        "from pathlib import Path",
        "from harness.experiments.full_disk import full_disk",
        f"r = full_disk({binary_expr}, {arch!r})",
        "print('\\n'.join(r.problems) or f'no partial file: {r.checked} saves, findings {dict(r.findings)}')",
        "if r.died is not None:",
        "    print(f'the server died on a save: {r.died.describe()}')",
        "raise SystemExit(1 if r.problems or r.died is not None else 0)",
    ])  # fmt: skip
