"""Native allocation failures inside libllama: the state calls and ``llama_decode`` under the shim.

For one tiny fixtures model and one operation, :func:`sweep_llama_native` fails native allocation
1, 2, 3, ... made *inside that one call* (the shim is armed right before the ctypes call and
disarmed right after it; buffers and batches are prepared before arming) until the call completes
with no fault fired, SQLite style. Operations:

``get``       ``llama_state_seq_get_data_ext(flags=0)`` of a sequence (what a cache save does)
``get-part``  the same with ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` (a checkpoint)
``set``       ``llama_state_seq_set_data_ext(flags=0)`` into an empty sequence (a cache load)
``decode``    ``llama_decode`` of a few tokens continuing a sequence

Each trial's outcome is a :class:`faults.kinds.Outcome`, its layer's word first in the detail:

``ok``                  ``completed``: no allocation failed; the call makes fewer than ``nth``
                        allocations, and the sweep ends
``accepted-error``      ``reported``: the fault fired and the call returned its failure value (0 bytes,
                        ret != 0); afterwards the context still works (a clean retry succeeds); or
                        ``absorbed``: the fault fired, the call succeeded, its result is exactly the clean one
``violation``           ``wrong``: the fault fired, the call claimed success, but its result differs
``aborted``             the process died of SIGABRT (a ``bad_alloc`` or ``GGML_ABORT`` nobody caught):
                        reported with the native and Python stacks and the allocation number
``killed``              another fatal signal (SIGSEGV ...), a hang, or an exit without a report: a
                        finding, with stacks
``crash-out-of-scope``  ``python-error``: the failed allocation was Python's own (``MemoryError``
                        around the call), not libllama's

Every trial also records where the allocation that failed was made (``alloc_site``, observed: the call
stack the shim wrote when it failed it, reduced by :func:`faults.sites.site_of` to its first llama.cpp
frame, ``libllama.so:llama_context::state_seq_get_data``; ``-`` when none failed), beside ``site``, the
first libllama/ggml frame of the crash's own stack (where a ``bad_alloc`` escaped, or the SIGSEGV).

One child process (``python -m faults.llama_native --child``, under the shim) loads the model once
and runs each trial in a forked copy of itself (:func:`harness.child.run_child` with a function),
so a trial that aborts takes only itself down; when the child itself dies, the next child resumes
at the following allocation number. Each trial id (``lfm2.set.7``) replays it:
``python -m harness native --case lfm2.set.7``.

Size: ``_child`` runs one whole trial (load, arm, call, classify, report) top to bottom, so the trial reads as
its own reproducer; split, its steps would pass half-built llama state around.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from faults.kinds import Outcome, died
from faults.native import ShimControl, run_native
from faults.sites import Symbolizer, allocation_text, observe
from fixtures.gguf import model_path
from harness.child import ChildResult, child_setup, run_child
from harness.targets.libllama import LlamaProvider, load_model
from harness.trees.driver import libllama

__all__ = ["OPS", "LlamaNativeReport", "NativeTrial", "sweep_llama_native"]

OPS = ("get", "get-part", "set", "decode")
_RESULT = "NATIVE-TRIAL "
_COMPLETED = 10  # a forked trial's exit status when the call completed with no fault fired
_TRIAL_TIMEOUT = 60.0  # one forked trial; a hang is a ``killed`` trial and the sweep goes on


@dataclass
class NativeTrial:
    case: str
    nth: int
    outcome: Outcome
    detail: str = ""
    stacks: str = ""
    alloc_site: str = ""  # where the failed allocation was made (``-``: none failed; ``""``: not recorded)


@dataclass
class LlamaNativeReport:
    arch: str
    op: str
    trials: list[NativeTrial] = field(default_factory=list)
    capped: bool = False

    @property
    def counts(self) -> Counter[Outcome]:
        return Counter(t.outcome for t in self.trials)

    @property
    def findings(self) -> list[NativeTrial]:
        return [t for t in self.trials if t.outcome.failed]

    def groups(self) -> list[dict[str, Any]]:
        """Findings grouped by outcome and the first libllama/ggml frame: one row per distinct failure site."""
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for t in self.findings:
            site = _site(t.stacks)
            first = {"outcome": t.outcome, "detail": t.detail, "site": site, "first_case": t.case, "count": 0}
            first["alloc_site"] = t.alloc_site
            row = rows.setdefault((t.outcome, site), {**first, "stack": _first_frames(t.stacks), "alloc_sites": []})
            row["count"] += 1
            if t.alloc_site not in row["alloc_sites"]:
                row["alloc_sites"].append(t.alloc_site)
        return list(rows.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "arch": self.arch,
            "op": self.op,
            "allocations_swept": max((t.nth for t in self.trials if t.outcome != Outcome.OK), default=0),
            "capped": self.capped,
            "outcomes": dict(self.counts),
            "findings": self.groups(),
        }


def _site(stacks: str) -> str:
    """The first frame of libllama or ggml with a symbol: where the failure escaped or crashed."""
    for line in _first_frames(stacks, 40).splitlines():
        m = re.search(r"\((.+?)\+0x[0-9a-f]+\)", line)
        if m and ("llama" in m.group(1) or "ggml" in m.group(1)) and "std::" not in m.group(1).split("(")[0]:
            return m.group(1)
    return "?"


def _first_frames(stacks: str, n: int = 10) -> str:
    """The native frames that matter: below the signal machinery (libc, the shim), demangled."""
    text = stacks.split("native stack (faultshim", 1)
    if len(text) < 2:
        return "\n".join(stacks.strip().splitlines()[:n])
    frames = [
        ln.strip()
        for ln in text[1].splitlines()[1:]
        if ln.strip() and "shim-" not in ln and "libc.so" not in ln and "libstdc++" not in ln
    ]
    return _demangle("\n".join(frames[:n]))


def _demangle(text: str) -> str:
    import shutil
    import subprocess

    tool = shutil.which("c++filt")
    if tool is None or not text:
        return text
    try:
        return subprocess.run([tool], input=text, capture_output=True, text=True, timeout=10).stdout.strip() or text
    except (OSError, subprocess.TimeoutExpired):
        return text


def sweep_llama_native(
    arch: str, op: str, *, first: int = 1, max_nth: int = 3000, timeout: float = 300.0
) -> LlamaNativeReport:
    """Sweep allocation numbers ``first..`` of ``op`` on ``arch``'s model until one completes."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    report = LlamaNativeReport(arch, op)
    symbolizer = Symbolizer()  # one for the sweep: each address is named once
    nth = first
    while nth <= max_nth:
        # ggml's own crash backtrace attaches gdb to the dying process: seconds per trial; the shim
        # and faulthandler already capture the stacks
        env = dict(os.environ, GGML_NO_BACKTRACE="1")
        child = run_native(
            [sys.executable, "-m", "faults.llama_native", "--child", arch, op, str(nth), str(max_nth)],
            timeout=timeout,
            env=env,
        )
        done = _parse(report, child, symbolizer)
        last = max((t.nth for t in report.trials), default=nth - 1)
        if done:
            return report
        if child.crashed or child.returncode != 0:
            report.trials.append(
                NativeTrial(
                    f"{arch}.{op}.{last + 1}",
                    last + 1,
                    _death(child),
                    child.describe() + (": " + child.stderr.strip().splitlines()[-1] if child.stderr.strip() else ""),
                    child.stacks,
                    observe(allocation_text(child.stacks), symbolizer=symbolizer).fault(),
                )
            )
            nth = last + 2
        else:
            nth = last + 1
    report.capped = True
    return report


def _death(child: ChildResult) -> Outcome:
    if child.status == "exited" and "MemoryError" in child.stderr:
        return Outcome.CRASH_OUT_OF_SCOPE  # python-error: the failed allocation was Python's own
    return died(child)


def _parse(report: LlamaNativeReport, child: ChildResult, symbolizer: Symbolizer) -> bool:
    done = False
    for line in child.stdout.splitlines():
        if not line.startswith(_RESULT):
            continue
        row = json.loads(line[len(_RESULT) :])
        t = NativeTrial(
            f"{report.arch}.{report.op}.{row['nth']}",
            row["nth"],
            Outcome(row["outcome"]),
            row.get("detail", ""),
            row.get("stacks", ""),
            observe(row.get("alloc_stacks", ""), symbolizer=symbolizer).fault(),
        )
        report.trials.append(t)
        if t.outcome == Outcome.OK:
            done = True
    return done


# ---- the child ----------------------------------------------------------------------------


def _child(arch: str, op: str, start: int, stop: int) -> int:
    ll = libllama()
    child_setup()
    shim = ShimControl()
    flags = 1 if op == "get-part" else 0
    prov = LlamaProvider(load_model(model_path(arch)), n_seq=2, n_ctx=256, n_batch=16, n_ubatch=8, check_restores=False)
    ctx = prov.ctx
    prompt = [3 + (i * 5) % 250 for i in range(24)]

    def reset() -> None:
        ll.llama_memory_clear(prov.mem, True)
        for s in (0, 1):
            ret, _ = prov._decode_raw(ctx, s, prompt[:16], 0, want_logits=False)
            assert ret == 0
            ret, _ = prov._decode_raw(ctx, s, prompt[16:], 16, want_logits=False)
            assert ret == 0

    reset()
    size = int(ll.llama_state_seq_get_size_ext(ctx, 0, flags))
    clean_state = prov._raw_state(ctx, 0, flags)
    nxt = [7, 8, 9]
    ret, clean_logits = prov._decode_raw(ctx, 1, nxt, len(prompt), want_logits=True)
    assert ret == 0

    def trial(nth: int) -> tuple[Outcome, str]:
        reset()
        detail = ""
        try:
            if op in ("get", "get-part"):
                buf = ll.buffer(size)
                shim.arm(nth)
                n = ll.llama_state_seq_get_data_ext(ctx, buf, size, 0, flags)
                fired = shim.disarm()
                ok = n == size
                same = ok and ll.bytes_at(buf, n) == clean_state
            elif op == "set":
                ll.llama_memory_seq_rm(prov.mem, 1, -1, -1)
                src = ll.buffer_of(clean_state)
                shim.arm(nth)
                n = ll.llama_state_seq_set_data_ext(ctx, src, len(clean_state), 1, 0)
                fired = shim.disarm()
                ok = n == len(clean_state)
                same = ok and prov._raw_state(ctx, 1) == clean_state
            else:
                batch = ll.llama_batch_init(len(nxt), 0, 1)
                for i, t in enumerate(nxt):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, len(prompt) + i, 1
                    batch.seq_id[i][0] = 1
                    batch.logits[i] = i == len(nxt) - 1
                batch.n_tokens = len(nxt)
                shim.arm(nth)
                rc = ll.llama_decode(ctx, batch)
                fired = shim.disarm()
                ll.llama_batch_free(batch)
                ok = rc == 0
                detail = f"ret {rc}"
                same = ok and ll.bytes_at(ll.llama_get_logits_ith(ctx, -1), len(clean_logits)) == clean_logits
        except MemoryError as e:
            shim.disarm()
            return Outcome.CRASH_OUT_OF_SCOPE, f"python-error: MemoryError: {e}"
        if fired == 0:
            return Outcome.OK, f"completed {detail}".rstrip()
        if not ok:
            return Outcome.ACCEPTED, f"reported {detail}".rstrip()
        if same:
            return Outcome.ACCEPTED, f"absorbed {detail}".rstrip()
        return Outcome.VIOLATION, f"wrong {detail}".rstrip()

    def forked_trial(nth: int) -> int:
        outcome, detail = trial(nth)
        print(_RESULT + json.dumps({"nth": nth, "outcome": outcome, "detail": detail}))
        return _COMPLETED if outcome == Outcome.OK else 0

    # one forked process per trial: a trial that aborts takes only itself down
    for nth in range(start, stop + 1):
        done = run_child(functools.partial(forked_trial, nth), timeout=_TRIAL_TIMEOUT)
        # the trial's row, for the runner, with the stack of the allocation the shim failed in it
        alloc = allocation_text(done.stacks)
        for line in done.stdout.splitlines(keepends=True):
            if line.startswith(_RESULT):
                line = _RESULT + json.dumps({**json.loads(line[len(_RESULT) :]), "alloc_stacks": alloc}) + "\n"
            sys.stdout.write(line)
        sys.stderr.write(done.stderr)
        if done.crashed:
            row = {"nth": nth, "outcome": died(done), "detail": done.describe(), "stacks": done.stacks}
            print(_RESULT + json.dumps({**row, "alloc_stacks": alloc}), flush=True)
        elif done.returncode == _COMPLETED:
            return 0  # the trial printed its row: the call completed with no fault fired
        elif done.returncode != 0:
            row = {"nth": nth, "outcome": Outcome.KILLED, "detail": f"trial exited with {done.returncode}"}
            print(_RESULT + json.dumps({**row, "alloc_stacks": alloc}), flush=True)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":  # the child of one trial (see _sweep); the command is ``python -m harness native``
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        raise SystemExit(_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
    print("usage: python -m harness native [--arch NAME] [--op OP] [--case ARCH.OP.NTH]", file=sys.stderr)
    raise SystemExit(2)
