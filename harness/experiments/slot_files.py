"""The slot file name as an attack surface (issue #39, point 4): hostile names against a real ``llama-server``.

Upstream at 0c1e570: ``POST /slots/:id_slot?action=save|restore|erase`` (tools/server/server.cpp:291) answers
501 without ``--slot-save-path`` (tools/server/server-context.cpp:4754-4757); ``handle_slots_save`` and
``handle_slots_restore`` (:5271-5279, :5307-5315) parse the body (``json::parse``, ``.at("filename")``), check
``fs_validate_filename(filename)`` (common/common.cpp:796-876: length <= 255, valid UTF-8 without overlong
forms, no control, ``/ \\ : * ? " < > |``, U+2215, U+2216, U+FF0E, surrogates, U+FFFD, BOM, no leading or
trailing space, no trailing ``.``, no ``..`` anywhere) and open ``slot_save_path + filename`` with ``fopen``
(src/llama-context.cpp:3324, :3378 -> src/llama-mmap.cpp:220 -> ggml/src/ggml.c:627): symlinks are followed.
``handle_slots_erase`` (:5344-5368) takes no file name: it clears the slot's tokens (:2641-2664).

For every name of :mod:`.slot_names` (the explicit list, then ``examples`` generated ones) the sandbox of
:mod:`.slot_sandbox` is reset, then save, restore and erase are each sent with ``{"filename": name}``; around
each, the whole tree is snapshotted and inotify drained, so anything read, opened, created or changed outside
``save/`` is an escape of that request. The verdict of a name (``ok``, ``known:<finding>``, or a failure):

* no escape, unless it is a registered finding's (``slot-file-follows-symlink``: a planted symlink's own name,
  touching only what that symlink points to);
* ``refuse`` names: 4xx on save and restore (a 500 for a body the JSON parser refuses is the registered
  ``slot-action-bad-body-500``); ``benign``: 200 twice and the file ``save/<name>``; ``literal``: a 4xx, or
  a 2xx whose only change is ``save/<name>``; ``symlink``: any status. Erase must answer 200 and touch nothing.
"""

from __future__ import annotations

import http.client
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from fixtures.gguf import model_path
from harness.errors import RequestFailed
from harness.experiments.slot_names import Name, explicit_names, generated_names
from harness.experiments.slot_sandbox import SYMLINKS, Sandbox, diff
from harness.findings import SLOT_ACTION_BAD_BODY_500, SLOT_FILE_FOLLOWS_SYMLINK, KnownRow, finding
from harness.interrupt import check
from harness.targets.llama_server import Launch, ServerProcess

__all__ = ["ACTIONS", "KNOWN", "ActionResult", "NameResult", "SlotFilesReport", "run_slot_files"]

ACTIONS = ("save", "restore", "erase")
SYMLINK_FINDING = SLOT_FILE_FOLLOWS_SYMLINK.id
BAD_BODY_FINDING = SLOT_ACTION_BAD_BODY_500.id
KNOWN = frozenset({SYMLINK_FINDING, BAD_BODY_FINDING})

#: a hook called after a request's answer and before its effects are read (the tests plant a bug with it)
During = Callable[[Sandbox, Name, str], None]


@dataclass
class ActionResult:
    """One request: its status (None: no answer), the error text, what it touched outside and inside save/."""

    action: str
    status: int | None
    message: str
    outside: list[str] = field(default_factory=list)  # "root/outside/secret.bin: OPEN,ACCESS" / "...: changed"
    inside: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "message": self.message, "outside": self.outside, "inside": self.inside}


@dataclass
class NameResult:
    name: Name
    actions: dict[str, ActionResult]
    verdict: str = "ok"  # "ok" | "known:<id>" | "FAIL"
    reasons: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name.label, "class": self.name.cls, "source": self.name.source,
                "verdict": self.verdict, "reasons": self.reasons,
                **{a: r.to_json() for a, r in self.actions.items()}}  # fmt: skip


@dataclass
class SlotFilesReport:
    binary: str
    rows: list[NameResult] = field(default_factory=list)

    @property
    def failures(self) -> list[NameResult]:
        return [r for r in self.rows if r.verdict == "FAIL"]

    def counts(self) -> dict[str, dict[str, int]]:
        """Per class: names, and how many got each save/restore status pair, escaped, were known, failed."""
        out: dict[str, Counter[str]] = {}
        for r in self.rows:
            c = out.setdefault(r.name.cls, Counter())
            c["names"] += 1
            c[f"save {_cls(r.actions['save'].status)} / restore {_cls(r.actions['restore'].status)}"] += 1
            c["escaped"] += any(a.outside for a in r.actions.values())
            c[r.verdict] += 1
        return {k: dict(v) for k, v in sorted(out.items())}

    def known(self) -> dict[str, int]:
        return dict(Counter(r.verdict.removeprefix("known:") for r in self.rows if r.verdict.startswith("known:")))

    def to_json(self) -> dict[str, Any]:
        return {
            "command": "slot-files", "binary": self.binary, "names": len(self.rows), "counts": self.counts(),
            "known_findings": [KnownRow(finding(i), "llama-server slot files", "reproduced", count=n).to_json()
                               for i, n in sorted(self.known().items())],
            "failures": len(self.failures), "rows": [r.to_json() for r in self.rows],
        }  # fmt: skip


def _cls(status: int | None) -> str:
    return "none" if status is None else f"{status // 100}xx"


def _post(srv: ServerProcess, action: str, body: bytes) -> tuple[int | None, str]:
    """The raw request (the body as given, bytes JSON cannot spell included): status and error message."""
    assert srv.port is not None
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=srv.request_timeout)
    try:
        conn.request("POST", f"/slots/0?action={action}", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    except (OSError, http.client.HTTPException) as e:
        return None, f"no answer: {e}"
    finally:
        conn.close()
    try:
        err = json.loads(raw).get("error") or {}
        msg = str(err.get("message", "")) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        msg = raw[:200].decode(errors="replace")
    return resp.status, msg[:300]


def _request(sb: Sandbox, srv: ServerProcess, name: Name, action: str, during: During | None) -> ActionResult:
    before = sb.snapshot()
    sb.events()  # the snapshot's own reads, and anything before this request
    status, msg = _post(srv, action, name.body)
    if during is not None:
        during(sb, name, action)
    events = sb.events()
    changes = diff(before, sb.snapshot())
    res = ActionResult(action, status, msg)
    for e in events:
        (res.inside if sb.inside(e.path) else res.outside).append(f"{e.path}: {','.join(e.kinds)}")
    for line in changes:
        (res.inside if sb.inside(line.split(": ", 1)[0]) else res.outside).append(line)
    res.outside = sorted(set(res.outside))
    res.inside = sorted(set(res.inside))
    return res


def _symlink_explains(name: Name, lines: list[str]) -> bool:
    """Every outside touch is what the planted symlink of this very name points to (or, a directory, holds)."""
    if name.cls != "symlink" or name.text not in SYMLINKS:
        return False
    target = "root/" + SYMLINKS[name.text].removeprefix("../")
    parent = target.rsplit("/", 1)[0]  # creating the dangling link's target changes its directory's mtime

    def explained(line: str) -> bool:
        path, _, what = line.partition(": ")
        return path == target or path.startswith(target + "/") or (path == parent and what == "changed (mtime_ns)")

    return all(explained(line) for line in lines)


def _bad_body(name: Name, r: ActionResult) -> bool:
    """The 500 of a body nlohmann refuses (not JSON, not UTF-8, a lone surrogate, no string filename)."""
    unicode_ok = name.text is not None and not any(0xD800 <= ord(c) <= 0xDFFF for c in name.text)
    return r.status == 500 and not unicode_ok and r.message.startswith("[json.exception.")


def judge(r: NameResult, known: frozenset[str]) -> None:
    """Set ``r.verdict`` and ``r.reasons`` by the rules of the module's docstring."""
    n = r.name
    fail: list[str] = []
    hits: set[str] = set()
    for a, res in r.actions.items():
        if res.outside:
            if SYMLINK_FINDING in known and _symlink_explains(n, res.outside):
                hits.add(SYMLINK_FINDING)
            else:
                fail.append(f"{a} escaped: {'; '.join(res.outside[:4])}")
        if res.status is None:
            fail.append(f"{a}: {res.message}")
    for a in ("save", "restore"):
        res = r.actions[a]
        st = res.status or 0
        if n.cls == "refuse" and not 400 <= st < 500:
            if BAD_BODY_FINDING in known and _bad_body(n, res):
                hits.add(BAD_BODY_FINDING)
            else:
                fail.append(f"{a} answered {res.status} to a name that must be refused ({res.message!r})")
        elif n.cls == "benign" and st != 200:
            fail.append(f"{a} answered {res.status} to a benign name ({res.message!r})")
        elif n.cls == "literal" and st >= 500:
            fail.append(f"{a} answered {res.status} ({res.message!r})")
    save = r.actions["save"]
    own = f"root/save/{n.text}"
    if n.cls in ("benign", "literal") and save.status is not None and 200 <= save.status < 300:
        others = [line for line in save.inside if line.split(": ", 1)[0] not in (own, "root/save")]
        if not any(line.startswith(own + ": created") for line in save.inside) or others:
            fail.append(f"save answered {save.status}, but save/ changed as {save.inside[:4]}, not {own} alone")
    erase = r.actions["erase"]
    if erase.status != 200 or erase.inside:
        fail.append(f"erase answered {erase.status} ({erase.message!r}) and touched {erase.inside[:4]}")
    r.reasons = fail or sorted(f"known: {h}" for h in hits)
    r.verdict = "FAIL" if fail else (f"known:{min(hits)}" if hits else "ok")


def run_slot_files(
    binary: Path,
    *,
    examples: int = 50,
    seed: int = 0,
    known: frozenset[str] = KNOWN,
    during: During | None = None,
    names: list[Name] | None = None,
    progress: Callable[[str], None] | None = None,
) -> SlotFilesReport:
    """Every explicit name (or ``names``), then ``examples`` generated ones, against one server on the sandbox."""
    report = SlotFilesReport(str(binary))
    seen: set[bytes] = set()
    with Sandbox() as sb, ServerProcess(
        binary,
        Launch(
            model=model_path("llama"),
            n_parallel=1,
            ctx_size=256,
            cache_ram=0,
            args=["--slot-save-path", str(sb.save), "--no-warmup"],
        ),
    ) as srv:  # fmt: skip

        def one(name: Name) -> None:
            check()
            if name.body in seen:
                return
            seen.add(name.body)
            sb.reset()
            if name.cls == "benign":
                srv.completion([1 + i % 50 for i in range(12)], 2)  # a slot with a prompt: a real state to save
            res = NameResult(name, {a: _request(sb, srv, name, a, during) for a in ACTIONS})
            judge(res, known)
            report.rows.append(res)
            if progress is not None and res.verdict == "FAIL":
                progress(f"FAIL {name.label[:60]}: {'; '.join(res.reasons)[:200]}")
            if not srv.running():
                rc = srv.proc.poll() if srv.proc is not None else None
                raise RequestFailed("POST", "/slots/0", "dropped", alive=False, server_exit=rc)

        for name in names if names is not None else explicit_names(sb.base):
            one(name)
        if examples > 0 and names is None:

            @hypothesis_seed(seed)
            @settings(max_examples=examples, database=None, phases=[Phase.generate], deadline=None,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            @given(generated_names())
            def drive(name: Name) -> None:
                one(name)

            drive()
    return report
