"""``python -m harness slot-files``: hostile slot file names against a real llama-server, the sandbox watched.

The run is :func:`harness.experiments.slot_files.run_slot_files`: every explicit name of
:mod:`harness.experiments.slot_names`, then ``--examples`` generated ones, each sent to
``POST /slots/0?action=save``, ``restore`` and ``erase`` on a server whose ``--slot-save-path`` is a sandbox
watched by snapshots and inotify. One row per name: its class, the three statuses, what it touched outside
the save directory, its verdict. Registered findings (``slot-file-follows-symlink``, ``slot-action-bad-body-500``
in :mod:`harness.findings`) are reported as known and do not fail the run, as in the gate; anything else that
escapes, a name that must be refused and is not answered 4xx, or a benign name not saved is a failure.

``--differential`` runs instead the slot-file differential: ``--examples`` Hypothesis-generated programs of saves,
restores, erases and completions per model of ``--arch`` (all five by default; seeded by ``--seed``:
:mod:`harness.load.slot_programs`), each step against the model (statuses, token counts,
``timings.cache_n``) and, after every restore, a fresh evaluation (outputs); a difference a registered finding's
exact condition explains is counted under it, any other fails with the shrunk program, the seed and the command
line that replays it. Then the fixed programs of :mod:`harness.experiments.slot_restore` as the smoke case
(``--rounds``), a restore on a speculative slot and the full-disk case on a 64 KiB tmpfs (root only); JSON figures
on stdout (and ``--json``). Exit 1 on a mismatch; the registered findings it shows are listed as known.

Exit 0 when nothing but known findings showed, 1 on a failure, 3 when the server died, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from harness.commands.common import add_archs, add_server_options, archs_of, resolve_server
from harness.errors import EXIT_FAILED, EXIT_OK, UsageError
from harness.experiments.slot_files import ACTIONS, NameResult, SlotFilesReport, run_slot_files
from harness.experiments.slot_restore import enospc, run_differential, stale_draft
from harness.findings import (
    SLOT_RESTORE_DROPS_CHECKPOINTS,
    SLOT_RESTORE_STALE_DRAFT,
    SLOT_RESTORE_TRUNCATED_FILE_ABORT,
    SLOT_SAVE_PARTIAL_FILE,
    SLOT_SAVE_SILENT_TRUNCATION,
    KnownRow,
    finding,
)
from harness.load.slot_programs import ARCHS, command_line, run_model

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--examples", type=int, default=50, metavar="N",
                        help="generated names after the explicit list (50; 0: the list only); --differential: "
                             "generated programs per model (0: the fixed smoke programs only)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the generated names' or programs' seed (0)")
    add_server_options(parser, asan=False)
    parser.add_argument("--json", metavar="PATH", help="write every name's requests and effects as JSON")
    parser.add_argument("--differential", action="store_true",
                        help="save/restore/erase between completions against the model and a fresh server, "
                             "then a save on a full tmpfs (root), instead of the names")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="--differential: rounds of the fixed smoke programs per model (1)")  # fmt: skip
    add_archs(parser, ARCHS, "--differential: the fixture models of the generated programs")


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _row(r: NameResult) -> list[str]:
    touched = sorted({line.split(": ", 1)[0] for a in r.actions.values() for line in a.outside})
    return [
        _short(r.name.label, 44), r.name.cls, *(str(r.actions[a].status) for a in ACTIONS),
        _short(", ".join(touched) or "-", 40), r.verdict,
    ]  # fmt: skip


def table(rep: SlotFilesReport) -> str:
    head = ["name", "class", *ACTIONS, "touched outside save/", "verdict"]
    rows = [head, *(_row(r) for r in rep.rows)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def run(args: argparse.Namespace) -> int:
    if args.examples < 0:
        raise UsageError(f"--examples must be >= 0, got {args.examples}")
    if args.rounds < 1:
        raise UsageError(f"--rounds must be >= 1, got {args.rounds}")
    archs_of(args, ARCHS)  # before any build: a bad name is one line
    binary = resolve_server(args).binary
    if args.differential:
        return _differential(binary, args)
    rep = run_slot_files(binary, examples=args.examples, seed=args.seed,
                         progress=lambda m: print("  " + m, file=sys.stderr))  # fmt: skip
    print(table(rep))
    print(f"\n{len(rep.rows)} names tried ({sum(r.name.source == 'generated' for r in rep.rows)} generated)")
    for cls, counts in rep.counts().items():
        print(f"  {cls}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    for fid, n in sorted(rep.known().items()):
        f = finding(fid)
        print(f"KNOWN {fid} ({n} names): {_short(f.title, 160)}; reproducer {f.reproducer}")
    if args.json:
        Path(args.json).write_text(json.dumps(rep.to_json(), indent=1, ensure_ascii=True) + "\n")
    for r in rep.failures:
        print(f"FAIL {r.name.label} [{r.name.cls}]: {'; '.join(r.reasons)}")
    if rep.failures:
        return EXIT_FAILED
    print("PASS: nothing read or written outside --slot-save-path but the known findings; every name that must be "
          "refused got a 4xx (or the known 500); every benign name was saved in place")  # fmt: skip
    return EXIT_OK


def _generated(binary: Path, args: argparse.Namespace) -> tuple[list[dict[str, object]], list[str]]:
    """The generated programs on every model of ``--arch``: one line each; the figures and the failures."""
    archs = archs_of(args, ARCHS) if args.examples else ()
    rows, failures = [], []
    for arch in archs:
        f = run_model(arch, binary, examples=args.examples, seed=args.seed)
        rows.append(f.to_json())
        found = ", ".join(f"{k} {v}" for k, v in sorted(f.findings.items())) or "none"
        print(f"  [{'FAIL' if f.failure else 'ok  '}] {arch:<7} {f.examples} programs, {f.requests} requests, "
              f"{f.actions} actions, {f.restores} restores, {f.compared} outputs compared after a restore "
              f"({f.outputs_equal} equal); findings: {found}; {f.tokens_reprocessed} tokens reprocessed",
              file=sys.stderr)  # fmt: skip
        if f.failure is not None:
            again = command_line((arch,), args.examples, args.seed)
            failures.append(f"{arch} seed {args.seed}: {f.failure.name}: {f.failure.message}\n"
                            f"  the shrunk program (paste into python from the repository root):\n"
                            f"{f.failure.program}\n  replay the run: {again}")  # fmt: skip
    return rows, failures


def _differential(binary: Path, args: argparse.Namespace) -> int:
    generated, failures = _generated(binary, args)
    out = run_differential(binary, rounds=args.rounds, seed=args.seed)
    out["generated"] = {"examples": args.examples, "seed": args.seed, "models": generated}
    out["stale_draft"] = stale_draft(binary)
    out["enospc"] = enospc(binary)
    known = [SLOT_RESTORE_DROPS_CHECKPOINTS.id] if out["total"]["tokens_reprocessed"] else []
    known += [fid for row in generated for fid in row["findings"]]  # type: ignore[attr-defined]
    if out["stale_draft"]["after_other_prompt"]["status"] == 500:
        known.append(SLOT_RESTORE_STALE_DRAFT.id)
    for c in out["enospc"]["cases"]:
        if c["save_status"] == 500 and c["file_bytes"]:
            known.append(SLOT_SAVE_PARTIAL_FILE.id)
        if c["save_status"] == 200 and c["file_bytes"] != c["n_written"]:
            known.append(SLOT_SAVE_SILENT_TRUNCATION.id)
        if c["restore"] == "server died":
            known.append(SLOT_RESTORE_TRUNCATED_FILE_ABORT.id)
    out["known_findings"] = [
        KnownRow(finding(i), "llama-server slot files", "reproduced").to_json() for i in dict.fromkeys(known)
    ]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    _summary(out)
    for m in [*failures, *out["mismatches"]]:
        print(f"FAIL {m}")
    bad = out["mismatches"] or failures
    print(("FAIL" if bad else "PASS") + f": {len(generated)} models of generated programs, the fixed programs on "
          f"{len(out['models'])} configurations, {len(out['mismatches']) + len(failures)} failures"
          + ("" if args.json else " (--json PATH keeps every figure)"))  # fmt: skip
    return EXIT_FAILED if bad else EXIT_OK


def _summary(out: dict[str, Any]) -> None:
    """The fixed programs' totals, the stale draft, the full disk and the known findings, a line each."""
    t = out["total"]
    print(f"  fixed programs: {t['actions_matched']}/{t['actions']} actions and {t['cache_n_matched']}/{t['restores']} "
          f"restores' cache_n as the model predicts, {t['outputs_equal']}/{t['compared']} outputs equal a fresh "
          f"server's ({t['near_ties']} near ties), {t['tokens_reprocessed']} tokens reprocessed")  # fmt: skip
    d = out["stale_draft"]
    print(f"  draft after a restore ({d['arch']}): another prompt answered {d['after_other_prompt']['status']}, "
          f"after an erase {d['after_erase']['status']}")  # fmt: skip
    for c in out["enospc"]["cases"]:
        print(f"  full disk, {c['case']} ({c['free']} B free): save {c['save_status']}"
              + (f" n_written {c['n_written']}" if "n_written" in c else "")
              + f", {c['file_bytes']} B on disk (model predicted {c['predicted_status']}); restore: {c['restore']}")
    for f in out["known_findings"]:
        print(f"  KNOWN {f['id']}: reproducer {f['reproducer']}")
