"""The contract machine's configurations each in a forked child, so that libllama aborting (a ``GGML_ASSERT``, a
``SIGSEGV``) is one failure row of that configuration with the calls that led to it, not the end of the run.

:func:`run_config_isolated` runs :func:`~properties.libllama_contract.run_config` in a child
(:func:`harness.child.run_child`) whose engine is wrapped in a :class:`Journal`: every call the machine makes on
libllama through its engine (decode, state get and set, seq_rm, seq_cp, seq_keep, seq_add, clear) is appended to a
file, flushed, before it runs. A child that dies leaves its journal: the calls of the example that was running
(from its last ``example`` line) are the program that shows the abort, unshrunk (Hypothesis cannot shrink a dead
process), with the child's last ``GGML_ASSERT`` line as the message.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from harness.child import run_child
from harness.findings import RECURRENT_SEQ_RM_ALL_ABORT, Finding
from properties.libllama_contract import ContractConfig, Engine, run_config

__all__ = ["ABORTS", "Journal", "run_config_isolated"]

ABORTS: dict[str, Finding] = {"GGML_ASSERT(cell.has_seq_id(seq_id))": RECURRENT_SEQ_RM_ALL_ABORT}
"""The registered findings an abort shows, by the assertion the dying child printed."""

LOGGED = ("decode", "get", "set", "rm", "cp", "keep", "add", "clear", "flush")
"""The engine's calls the journal writes (the ones that change or read libllama's memory)."""


def _arg(v: Any) -> Any:
    if isinstance(v, bytes | bytearray):
        return f"<state {len(v)} B {hashlib.sha256(v).hexdigest()[:12]}>"
    if isinstance(v, tuple | list):
        return [_arg(x) for x in v]
    return v


class Journal:
    """An engine whose logged calls are written to ``out`` before they run; the rest is the engine's own."""

    def __init__(self, engine: Engine, out: TextIO) -> None:
        self._engine = engine
        self._out = out
        out.write("example\n")
        out.flush()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._engine, name)
        if name not in LOGGED or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            said = [_arg(a) for a in args] + ([{k: _arg(v) for k, v in kwargs.items()}] if kwargs else [])
            self._out.write(f"{name} {json.dumps(said)}\n")
            self._out.flush()
            res = attr(*args, **kwargs)
            if name == "get":
                self._out.write(f"  -> {_arg(res)}\n")
                self._out.flush()
            return res

        return call


def _last_example(journal: str, limit: int = 200) -> str:
    lines = journal.splitlines()
    start = max((i for i, line in enumerate(lines) if line == "example"), default=-1) + 1
    calls = lines[start:]
    head = "" if len(calls) <= limit else f"... {len(calls) - limit} earlier calls of this example\n"
    return head + "\n".join(calls[-limit:])


def _abort_line(stderr: str) -> str:
    said = [ln.strip() for ln in stderr.splitlines() if "GGML_ASSERT" in ln or "GGML_ABORT" in ln or "error" in ln]
    return said[0][:300] if said else ""


def run_config_isolated(
    cfg: ContractConfig,
    *,
    seed: int,
    max_examples: int,
    steps: int,
    wrap: Callable[[Engine], Engine] | None = None,
    timeout: float = 1800.0,
) -> dict[str, Any]:
    """:func:`run_config` in a forked child; a child that dies is the configuration's failure (``libllama_abort``)
    with the journal's calls of the example it died in."""
    with tempfile.TemporaryDirectory(prefix="contract-") as tmp:
        result, journal = Path(tmp) / "result.json", Path(tmp) / "journal.txt"

        def child() -> int:
            with journal.open("w") as out:
                journalled = (lambda e: Journal(wrap(e), out)) if wrap else (lambda e: Journal(e, out))
                r = run_config(cfg, seed=seed, max_examples=max_examples, steps=steps, wrap=journalled)  # type: ignore[arg-type]
            result.write_text(json.dumps(r))
            return 0

        res = run_child(child, timeout=timeout)
        if not res.crashed and result.is_file():
            data: dict[str, Any] = json.loads(result.read_text())
            return data
        calls = _last_example(journal.read_text(errors="replace")) if journal.is_file() else ""
    said = _abort_line(res.stderr)
    known = next((f for sig, f in ABORTS.items() if sig in said), None)
    row: dict[str, Any] = {
        "config": cfg.name, "seconds": round(res.elapsed, 2), "checks": {}, "calls": {}, "refused": {},
        "layout_diffs": 0, "ref_unavailable": 0, "ref_relayouts": 0, "findings": {}, "finding_counts": {},
        "failure": None,
    }  # fmt: skip
    program = "# the libllama calls of the example that died, in order (unshrunk: the process died)\n" + calls
    if known is not None:  # a registered finding: counted, the configuration's other examples unrun
        row["findings"] = {known.id: [f"{cfg.name}: the child {res.describe()}: {said}"]}
        row["finding_counts"] = {known.id: 1}
        return row
    row["failure"] = {"property": "libllama_abort", "program": program,
                      "message": f"the machine's child {res.describe()}" + (f": {said}" if said else "")}  # fmt: skip
    return row
