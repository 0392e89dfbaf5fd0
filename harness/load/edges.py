"""Requests at the edges of the slot actions and the prompt cache: the branches the gate's other programs never take.

The server gate's generated programs act on a slot between completions, restore only files its own server saved,
send plain names and token prompts to ``/completion``. Each case of :data:`EDGES` sends what they do not, on a
fresh server of its own, and checks what the answer and the next request show; the branch each one takes is named
beside it (llama.cpp 0c1e570, ``tools/server/server-context.cpp``):

``deferred-actions`` (``busy_slot_untouched``)
    a save, a restore and an erase sent while a completion runs on their slot are deferred (:2534, :2584, :2649)
    until it ends: the completion's tokens are those it generates alone, and each action then sees the finished
    slot (``n_saved``, ``n_restored``, ``n_erased`` the prompt plus the tokens generated but the last).
``client-gone`` (``busy_slot_untouched``)
    a save, a restore and an erase deferred behind a running completion whose clients close their connections
    (:5292, :5328, :5355: ``rd.next`` returns nothing only then): the server lives on and the completion's tokens
    are those it generates alone.
``foreign-files`` (``cleared_checkpoints``)
    a slot file whose token list is longer than the slot's context (:2612), one holding a token outside the
    vocabulary (:2616), one with a wrong magic, one whose token count runs past its end (src/llama-context.cpp:3331,
    :3343) and one of another model: each restore answers an error and clears the slot (``prompt_clear``, :2620), so
    the next request of the prompt it held resumes from nothing. Builds before b10405 restore the second with a 200: the
    registered finding ``slot-restore-accepts-foreign-tokens``, counted by its exact condition.
``hostile-name`` (``no_partial_file``)
    a save and a restore named ``../<name>`` (:5275, :5311, ``fs_validate_filename``): a 4xx, and no file written.
``no-checkpoints`` (``checkpoint_lists``)
    a recurrent model with ``--ctx-checkpoints 0`` (:3444): no checkpoint is ever created.
``checkpoint-search`` (``restore_equivalence``)
    both outcomes of the checkpoint search's last test (:3342): gemma2 (a 16-token window) resuming within its
    window from a checkpoint at position 0, and lfm2 resuming exactly where a checkpoint's state ends (passed over):
    each answer a fresh server's, within the batch-shape bound.
``reuse-unshiftable`` (``restore_equivalence``: no chunk moves, so the answer is the resumed slot's)
    a request's ``n_cache_reuse`` on a memory that cannot shift (:3214): gemma2's two caches differ in size
    (``llama_kv_cache_iswa::get_can_shift``, src/llama-kv-cache-iswa.cpp:253; a recurrent or hybrid memory shifts
    "trivially", llama-memory-hybrid.cpp:133): ignored with a warning, the answer a fresh server's (a server started
    with ``--cache-reuse`` there turns it off for every request, :1172, so the request asks for it itself).
``empty-draft`` (``restore_equivalence``)
    speculation with a draft model that proposes nothing (``--draft-p-min 0.99``, :3049): the answers are a fresh
    server's without a draft model.
``purge`` (``cleared_checkpoints``)
    a unified KV without room: the purge passes over an empty idle slot and clears one that holds a prompt
    (:1655, :1660), which then resumes from nothing; two slots processing with nothing idle to purge (the loop's
    end): both requests fail (HTTP 500) and their slots are cleared (:3693-3700).
``chat`` (``restore_equivalence``)
    chat turns on a hybrid, with the messages' delimiters the chat endpoint passes (:3531, :3588, :3608:
    checkpoints at the user messages' starts): the second turn resumes from the first, a four-turn conversation on
    an empty slot meets the spacing rule at its middle user messages (:3609: one declined, one taken); each answer
    a fresh server's within the batch-shape bound.

Each case returns its checks and its problems (an empty list: it held); a request that got no usable answer (the
server died, hung, or answered an error the case did not ask for) is a problem with its description.
:func:`edges_program` is the code that runs one case again (exit 1 when it finds a problem). The gate runs every case
after the server backend (:func:`harness.load.gate_step.server_edges_step`), about 10 seconds on the pinned build.
"""

from __future__ import annotations

import functools
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fixtures.gguf import draft_path, model_path
from harness.backends.llama_server.probe import ensure_form
from harness.errors import RequestFailed
from harness.findings import SLOT_RESTORE_ACCEPTS_FOREIGN_TOKENS
from harness.interrupt import check
from harness.load.generated import output_verdict
from harness.targets.llama_server import Launch, ServerProcess

__all__ = ["EDGES", "Edge", "EdgeResult", "edges_program", "forge_slot_file", "run_edge", "run_edges"]

PROMPT = (1, *(3 + (i * 7) % 40 for i in range(39)))  # 40 tokens
LONG = 2000  # tokens a running completion generates (about half a second): still running when the action arrives
GONE_S = 2.5  # ... and one that runs this long, with context shifts: the server polls a closed connection each second


@dataclass
class EdgeResult:
    """One case's outcome: ``checked`` checks of ``prop``, the ``problems`` found, what was ``seen``."""

    name: str
    prop: str
    checked: int = 0
    problems: list[str] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)
    findings: dict[str, int] = field(default_factory=dict)
    died: bool = False  # a server of the case died under a request (observed: the request's connection and its exit)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "property": self.prop, "checked": self.checked, "problems": self.problems,
                "seen": self.seen, "findings": self.findings, "died": self.died}  # fmt: skip


@dataclass(frozen=True)
class Edge:
    name: str
    prop: str
    reaches: str  # the branches it takes, server-context.cpp at 0c1e570
    run: Callable[[Path, Path, EdgeResult], None]


def _server(binary: Path, logs: Path, arch: str, *args: str, n_parallel: int = 1, ctx: int = 4096) -> ServerProcess:
    return ServerProcess(binary, Launch(model=model_path(arch), n_parallel=n_parallel, ctx_size=ctx, cache_ram=0,
                                        args=["-lv", "4", "--no-warmup", *args]),
                         log_path=logs / f"{arch}-{time.monotonic_ns()}.log")  # fmt: skip


def _tokens(r: Any) -> tuple[int, ...]:
    return tuple(int(t) for t in r.get("tokens") or ())


def _first_difference(got: tuple[int, ...], alone: tuple[int, ...]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(got, alone, strict=False)) if x != y), min(len(got), len(alone)))
    return (f"{len(got)} tokens generated, {len(alone)} alone; the first difference at token {i}: "
            f"{got[i:i + 4]} where alone {alone[i:i + 4]}")  # fmt: skip


def _long(srv: ServerProcess, box: dict[str, Any], n_predict: int) -> None:
    try:
        box["answer"] = srv.completion(PROMPT, n_predict, id_slot=0, ignore_eos=True, return_tokens=True)
    except RequestFailed as e:
        box["error"] = e
    box["done"] = time.monotonic()


def _while_running(srv: ServerProcess, action: Callable[[], Any], n_predict: int = LONG) -> tuple[Any, Any, bool]:
    """``action`` sent once slot 0 is processing a completion of ``n_predict`` tokens: (the completion's answer, the
    action's, whether the action was sent before the completion's answer came: it reached the server while the slot
    was busy)."""
    box: dict[str, Any] = {}
    t = threading.Thread(target=_long, args=(srv, box, n_predict), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(s.get("is_processing") for s in srv.request("GET", "/slots")):
        time.sleep(0.005)
    sent = time.monotonic()
    acted = action()
    t.join(timeout=120)
    if "error" in box:
        raise box["error"]
    return box.get("answer"), acted, sent < box.get("done", 0.0)


def deferred_actions(binary: Path, logs: Path, res: EdgeResult) -> None:
    save_dir = Path(tempfile.mkdtemp(prefix="edge-slots-", dir=logs))
    with _server(binary, logs, "llama", "--slot-save-path", f"{save_dir}/") as srv:
        alone = _tokens(srv.completion(PROMPT, LONG, id_slot=0, ignore_eos=True, return_tokens=True,
                                       cache_prompt=False))  # fmt: skip
        held = len(PROMPT) + len(alone) - 1  # the last token generated is not in the slot
        deferred = 0
        for action in ("save", "restore", "erase"):
            check()
            srv.completion(PROMPT[:10], 2, id_slot=0)  # the slot holds 11 tokens: an action not deferred shows it
            body = None if action == "erase" else {"filename": "busy.bin"}
            act = functools.partial(srv.request, "POST", f"/slots/0?action={action}", body)
            answer, acted, busy = _while_running(srv, act)
            deferred += busy
            got = _tokens(answer)
            res.checked += 1
            if got != alone:
                res.problems.append(f"a completion on slot 0 with a {action} of its slot sent while it ran: "
                                    f"{_first_difference(got, alone)}")
            n = acted.get({"save": "n_saved", "restore": "n_restored", "erase": "n_erased"}[action])
            if n != held:
                res.problems.append(f"the {action} sent while a completion ran on its slot answered {acted}: the "
                                    f"slot held {held} tokens once the completion ended")  # fmt: skip
        res.seen.append(f"{deferred} of 3 actions sent while the completion ran")


def client_gone(binary: Path, logs: Path, res: EdgeResult) -> None:
    """A save, a restore and an erase whose clients leave while the action waits for the slot. The server notices a
    closed connection when it polls (``HTTP_POLLING_SECONDS``, 1 s): the completion runs for about :data:`GONE_S`
    seconds (a generation past n_ctx, with context shifts, as long as this server makes it in that time), so each
    handler meets ``rd.next`` returning nothing while its action still waits."""
    save_dir = Path(tempfile.mkdtemp(prefix="edge-slots-", dir=logs))
    with _server(binary, logs, "llama", "--context-shift", "--slot-save-path", f"{save_dir}/") as srv:
        srv.completion(PROMPT, 4, id_slot=0)
        srv.request("POST", "/slots/0?action=save", {"filename": "gone.bin"})
        t0 = time.monotonic()
        srv.completion(PROMPT, LONG, id_slot=0, ignore_eos=True, cache_prompt=False)
        n_predict = max(LONG, int(LONG * GONE_S / max(time.monotonic() - t0, 1e-3)))  # about GONE_S seconds
        alone = _tokens(srv.completion(PROMPT, n_predict, id_slot=0, ignore_eos=True, return_tokens=True,
                                       cache_prompt=False))  # fmt: skip
        sent = 0
        for action, body in (("save", b'{"filename":"gone.bin"}'), ("restore", b'{"filename":"gone.bin"}'),
                             ("erase", b"")):  # fmt: skip
            check()

            def leave(a: str = action, b: bytes = body) -> None:
                with socket.create_connection((srv.host, srv.port), timeout=5) as s:
                    s.sendall(f"POST /slots/0?action={a} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              f"Content-Length: {len(b)}\r\n\r\n".encode() + b)  # fmt: skip
                    time.sleep(0.05)

            answer, _, busy = _while_running(srv, leave, n_predict)
            sent += busy
            res.checked += 1
            if _tokens(answer) != alone:
                res.problems.append(f"a completion whose slot's waiting {action} lost its client: "
                                    f"{_first_difference(_tokens(answer), alone)}")  # fmt: skip
            try:
                srv.health()
            except RequestFailed as e:
                res.problems.append(f"after a waiting {action}'s client left: {e.describe()}")
                return
        res.seen.append(f"{sent} of 3 actions sent while the completion ran")


def forge_slot_file(saved: bytes, tokens: list[int]) -> bytes:
    """A slot file with ``saved``'s state and ``tokens`` as its token list, in ``saved``'s format
    (``llama_state_seq_save_file``: magic, version, token count, tokens, state). Since upstream packs the slot's
    tokens (``server_tokens::serialize``, server-common.cpp:570 at 0c1e570) the list starts with a -1 marker, version
    1 and the count, and ends with the media count 0; before, it is the tokens alone."""
    magic, version, n = struct.unpack("<3I", saved[:12])
    state = saved[12 + 4 * n :]
    packed = n > 0 and struct.unpack("<i", saved[12:16])[0] == -1
    listed = [-1, 1, len(tokens), *tokens, 0] if packed else list(tokens)
    return struct.pack("<3I", magic, version, len(listed)) + struct.pack(f"<{len(listed)}i", *listed) + state


def foreign_files(binary: Path, logs: Path, res: EdgeResult) -> None:
    save_dir = Path(tempfile.mkdtemp(prefix="edge-slots-", dir=logs))
    with _server(binary, logs, "llama", "--slot-save-path", f"{save_dir}/", ctx=256) as other:
        other.completion(PROMPT, 4, id_slot=0)
        other.request("POST", "/slots/0?action=save", {"filename": "llama.bin"})
    with _server(binary, logs, "lfm2", "--slot-save-path", f"{save_dir}/", ctx=256) as srv:
        srv.completion(PROMPT, 4, id_slot=0)
        srv.request("POST", "/slots/0?action=save", {"filename": "own.bin"})
        saved = (save_dir / "own.bin").read_bytes()
        magic, version, n = struct.unpack("<3I", saved[:12])
        forged = {"long.bin": forge_slot_file(saved, [PROMPT[i % len(PROMPT)] for i in range(300)]),
                  "vocab.bin": forge_slot_file(saved, [*PROMPT[:4], 1_000_000, *PROMPT[5:]]),
                  # the header's magic off by one bit; a token count past the file's end (llama-context.cpp:3331,
                  # :3343); another model's state (llama's, into lfm2)
                  "magic.bin": struct.pack("<3I", magic ^ 1, version, n) + saved[12:],
                  "count.bin": struct.pack("<3I", magic, version, 1_000_000) + saved[12:],
                  "llama.bin": (save_dir / "llama.bin").read_bytes()}  # fmt: skip
        for name, data in forged.items():
            check()
            (save_dir / name).write_bytes(data)
            srv.completion(PROMPT, 4, id_slot=0)  # the slot holds PROMPT and its checkpoints again
            try:
                r = srv.request("POST", "/slots/0?action=restore", {"filename": name})
            except RequestFailed as e:
                if e.status is None:
                    raise
                res.seen.append(f"{name}: {e.status} {e.message}")
            else:
                if name != "vocab.bin":
                    res.problems.append(f"a restore of a forged file ({name}) answered 200: {r}")
                    continue
                # the registered finding's exact condition: one token past the vocabulary, and a 200
                found = SLOT_RESTORE_ACCEPTS_FOREIGN_TOKENS.id
                res.findings[found] = res.findings.get(found, 0) + 1
                res.seen.append(f"{name}: 200, n_restored {r.get('n_restored')} ({found})")
                continue
            again = srv.completion(PROMPT, 4, id_slot=0)
            res.checked += 1
            if int(again["timings"]["cache_n"]) != 0:
                res.problems.append(f"after a failed restore of {name} the slot resumed the prompt it held from "
                                    f"{again['timings']['cache_n']} tokens: not cleared")  # fmt: skip


def hostile_name(binary: Path, logs: Path, res: EdgeResult) -> None:
    save_dir = Path(tempfile.mkdtemp(prefix="edge-slots-", dir=logs)) / "save"
    save_dir.mkdir()
    with _server(binary, logs, "llama", "--slot-save-path", f"{save_dir}/") as srv:
        srv.completion(PROMPT, 4, id_slot=0)
        for action in ("save", "restore"):
            res.checked += 1
            try:
                r = srv.request("POST", f"/slots/0?action={action}", {"filename": "../escape.bin"})
                res.problems.append(f"a {action} named '../escape.bin' answered 200: {r}")
            except RequestFailed as e:
                if e.status is None or not 400 <= e.status < 500:
                    res.problems.append(f"a {action} named '../escape.bin': {e.describe()}")
        if (save_dir.parent / "escape.bin").exists() or any(save_dir.iterdir()):
            res.problems.append("a save named '../escape.bin' wrote a file")


def _created(srv: ServerProcess) -> int:
    return srv.log_through(0).count("created context checkpoint")


def no_checkpoints(binary: Path, logs: Path, res: EdgeResult) -> None:
    with _server(binary, logs, "lfm2", "--ctx-checkpoints", "0") as srv:
        for n in (len(PROMPT), 20):
            srv.completion(PROMPT[:n], 4, id_slot=0)
            res.checked += 1
        if _created(srv):
            res.problems.append(f"--ctx-checkpoints 0: the log shows {_created(srv)} checkpoints created")


def _against_fresh(fresh: ServerProcess, res: EdgeResult, prompt: tuple[int, ...], answer: Any, arch: str) -> None:
    res.checked += 1
    found, problem = output_verdict(fresh, prompt, _tokens(answer), int(answer["timings"]["cache_n"]), arch)
    if found:
        res.findings[found] = res.findings.get(found, 0) + 1
    elif problem is not None:
        res.problems.append(f"{arch}, a prompt of {len(prompt)} tokens: {problem}")


def checkpoint_search(binary: Path, logs: Path, res: EdgeResult) -> None:
    """Both outcomes of the search's last test (:3342, ``cur.pos_min < pos_min_thold || cur.pos_min == 0``): gemma2
    resuming within its window from a checkpoint at position 0 (the threshold is 0), and lfm2 resuming exactly at
    a checkpoint's position (its state is one token past the resume point: passed over)."""
    restored = 0
    with _server(binary, logs, "gemma2", ctx=256) as srv, _server(binary, logs, "gemma2", ctx=256) as fresh:
        first = PROMPT[:14]
        srv.completion(first, 2, id_slot=0)
        second = (*first[:12], 200, 201)
        _against_fresh(fresh, res, second, srv.completion(second, 4, id_slot=0, return_tokens=True, n_probs=2),
                       "gemma2")  # fmt: skip
        restored += srv.log_through(0).count("restored context checkpoint")
    with _server(binary, logs, "lfm2", ctx=256) as srv, _server(binary, logs, "lfm2", ctx=256) as fresh:
        srv.completion(PROMPT, 4, id_slot=0)  # a checkpoint of the state after 36 tokens (pos_max 35)
        second = (*PROMPT[:35], 200, 201, 202, 203)
        _against_fresh(fresh, res, second, srv.completion(second, 4, id_slot=0, return_tokens=True, n_probs=2),
                       "lfm2")  # fmt: skip
        passed = srv.log_through(0).count("checking checkpoint with [35, 35] against 35")
    res.seen.append(f"{restored} checkpoints restored (gemma2); {passed} passed over at the resume point (lfm2)")


def reuse_unshiftable(binary: Path, logs: Path, res: EdgeResult) -> None:
    # at -c 4096 the window's cache is smaller than the base cache (at -c 256 both hold 256 cells, and it shifts)
    with _server(binary, logs, "gemma2") as srv, _server(binary, logs, "gemma2") as fresh:
        srv.completion(PROMPT, 4, id_slot=0)
        second = (*PROMPT[:10], *PROMPT[16:], 5, 6, 7)
        answer = srv.completion(second, 4, id_slot=0, return_tokens=True, n_probs=2, n_cache_reuse=4)
        _against_fresh(fresh, res, second, answer, "gemma2")
        # the warning says the branch was taken (a tree without the request's n_cache_reuse ignores it)
        res.seen.append(f"{srv.log_through(0).count('cache reuse is not supported')} 'cache reuse is not supported' "
                        f"warnings")  # fmt: skip


#: chatml's message delimiters (the fixtures' GGUFs carry no template: llama-server falls back to chatml), as the
#: chat endpoint passes them to the completion it makes (server-common.cpp:1410, ``message_delimiters``)
CHATML = [{"role": r, "delimiter": f"<|im_start|>{r}"} for r in ("system", "user", "assistant")]


def chat(binary: Path, logs: Path, res: EdgeResult) -> None:
    """Chat turns as the chat endpoint sends them (the template applied, the messages' delimiters given), sent to
    ``/completion`` as tokens so that each answer's tokens can be held to a fresh server's: a second turn that
    resumes from the first (a checkpoint at the last user message), then a four-turn conversation on the other,
    empty slot, whose middle user messages start more than ``-ub`` tokens before the end: the spacing rule
    (``-cms``, :3609) declines the first and takes the second."""

    def tokens(srv: ServerProcess, messages: list[dict[str, str]]) -> tuple[int, ...]:
        text = srv.request("POST", "/apply-template", {"messages": messages})["prompt"]
        return tuple(srv.request("POST", "/tokenize", {"content": text, "add_special": True,
                                                       "parse_special": True})["tokens"])  # fmt: skip

    with (_server(binary, logs, "jamba", "-ub", "64", "-cms", "100", n_parallel=2, ctx=1024) as srv,
          _server(binary, logs, "jamba", ctx=512) as fresh):  # fmt: skip
        talk = [{"role": "system", "content": "be brief " * 8}, {"role": "user", "content": "hello there " * 6}]
        first = srv.completion(tokens(srv, talk), 4, id_slot=0, message_delimiters=CHATML)
        talk += [{"role": "assistant", "content": first["content"]}, {"role": "user", "content": "and again " * 6}]
        second = tokens(srv, talk)
        answer = srv.completion(second, 4, id_slot=0, message_delimiters=CHATML, return_tokens=True, n_probs=2)
        _against_fresh(fresh, res, second, answer, "jamba")
        res.seen.append(f"the second turn resumed from {answer['timings']['cache_n']} of {len(second)} tokens")
        # four user messages starting at 49, 140, 237 and 334 (the last): with -cms 100, 140 is within the spacing
        # of the checkpoint at 49 (none made) and 237 beyond it (one made)
        talk = [{"role": "system", "content": "be brief " * 2}, {"role": "user", "content": "hello there " * 2}]
        for text in ("and again " * 3, "once more " * 3, "last one " * 3):
            talk += [{"role": "assistant", "content": "ok " * 2}, {"role": "user", "content": text}]
        whole = tokens(srv, talk)
        answer = srv.completion(whole, 4, id_slot=1, message_delimiters=CHATML, return_tokens=True, n_probs=2)
        _against_fresh(fresh, res, whole, answer, "jamba")
        res.seen.append(f"{srv.log_through(0).count('created context checkpoint')} checkpoints created")


def empty_draft(binary: Path, logs: Path, res: EdgeResult) -> None:
    """Speculation whose draft model proposes nothing (every proposal under ``--draft-p-min 0.99``): the slot drafts
    (:3016) and meets an empty draft (:3049); its answers are a fresh server's (no draft model) within the bound."""
    launch = Launch(model=model_path("llama"), draft=draft_path(), n_parallel=1, ctx_size=256, cache_ram=0,
                    args=["-lv", "4", "--no-warmup", "--draft-p-min", "0.99"])  # fmt: skip
    with (ServerProcess(binary, launch, log_path=logs / f"draft-{time.monotonic_ns()}.log") as srv,
          _server(binary, logs, "llama", ctx=256) as fresh):  # fmt: skip
        for prompt in (PROMPT, (*PROMPT[:30], 200, 201, 202)):
            answer = srv.completion(prompt, 8, id_slot=0, ignore_eos=True, return_tokens=True, n_probs=2)
            _against_fresh(fresh, res, prompt, answer, "llama")
            res.seen.append(f"{answer['timings'].get('draft_n', 0)} tokens drafted")


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    return (1, *(3 + (seed * 13 + i * 7) % 200 for i in range(n - 1)))


def purge(binary: Path, logs: Path, res: EdgeResult) -> None:
    with ServerProcess(binary, Launch(model=model_path("llama"), n_parallel=3, ctx_size=512, cache_ram=0,
                                      kv_unified=True, args=["-lv", "4", "--no-warmup"]),
                       log_path=logs / f"purge-{time.monotonic_ns()}.log") as srv:  # fmt: skip
        srv.completion(_prompt(1, 300), 4, id_slot=1)
        srv.completion(_prompt(2, 300), 4, id_slot=2)  # no room: slot 0 (empty) is passed over, slot 1 purged
        purged = "purging slot 1 with" in srv.log_through(0)
        again = srv.completion(_prompt(1, 300), 4, id_slot=1)
        res.checked += 1
        res.seen.append(f"slot 1 {'purged' if purged else 'not purged'}")
        if purged and int(again["timings"]["cache_n"]) != 0:
            res.problems.append(f"slot 1, purged to make room in the unified KV, resumed its prompt from "
                                f"{again['timings']['cache_n']} tokens")  # fmt: skip
        failed: dict[int, str] = {}

        def both(k: int) -> None:  # two slots processing, the third empty: nothing to purge (the loop's end)
            try:
                srv.completion(_prompt(k, 300), 200, id_slot=k - 5, ignore_eos=True)
            except RequestFailed as e:
                failed[k] = e.describe()

        threads = [threading.Thread(target=both, args=(k,), daemon=True) for k in (5, 6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        res.seen.append(f"{len(failed)} of 2 requests without room failed")
        after = srv.completion(_prompt(5, 300), 4, id_slot=0)
        res.checked += 1
        if any("HTTP 500" not in f for f in failed.values()):
            res.problems.append(f"two requests with no room in the unified KV and no idle slot to purge: {failed}")
        elif len(failed) == 2 and int(after["timings"]["cache_n"]) != 0:
            res.problems.append(f"a slot whose request failed for want of room resumed its prompt from "
                                f"{after['timings']['cache_n']} tokens: not cleared")  # fmt: skip


EDGES: tuple[Edge, ...] = (
    Edge("deferred-actions", "busy_slot_untouched", ":2534 :2584 :2649 (is_processing: defer)", deferred_actions),
    Edge("client-gone", "busy_slot_untouched", ":5292 :5328 :5355 (rd.next: the connection closed)", client_gone),
    Edge("foreign-files", "cleared_checkpoints", ":2612 :2616 (too long, a token outside the vocabulary, a bad header, "
         "another model)", foreign_files),
    Edge("hostile-name", "no_partial_file", ":5275 :5311 (fs_validate_filename)", hostile_name),
    Edge("no-checkpoints", "checkpoint_lists", ":3444 (n_ctx_checkpoints 0)", no_checkpoints),
    Edge("checkpoint-search", "restore_equivalence", ":3342 (a checkpoint at position 0; one at the resume point)",
         checkpoint_search),
    Edge("reuse-unshiftable", "restore_equivalence", ":3214 (n_cache_reuse on a memory that cannot shift)",
         reuse_unshiftable),
    Edge("chat", "restore_equivalence", ":3531 :3588 :3608 (message spans; the spacing rule between them)", chat),
    Edge("empty-draft", "restore_equivalence", ":3049 (a draft the draft model left empty)", empty_draft),
    Edge("purge", "cleared_checkpoints", ":1655 :1660 (an empty idle slot passed over; no idle slot to purge)", purge),
)  # fmt: skip


def run_edge(edge: Edge, binary: Path, logs: Path) -> EdgeResult:
    """One case on ``binary``: a request that got no usable answer (the server died, hung or answered an error
    the case did not ask for) is a problem of the case, with its description."""
    res = EdgeResult(edge.name, edge.prop)
    try:
        edge.run(binary, logs, res)
    except RequestFailed as e:
        res.problems.append(f"a request got no usable answer: {e.describe()}")
        res.died = not e.alive
    return res


def run_edges(binary: Path, log_dir: str | None = None, names: tuple[str, ...] | None = None) -> list[EdgeResult]:
    """The cases of :data:`EDGES` (those ``names`` says) on ``binary``, driven in the request form its version
    answers (:func:`~harness.backends.llama_server.probe.ensure_form`, as the gate's run did)."""
    ensure_form(binary)
    with tempfile.TemporaryDirectory(prefix="edges-", dir=log_dir) as logs:
        return [run_edge(e, binary, Path(logs)) for e in EDGES if names is None or e.name in names]


def edges_program(binary_expr: str, name: str) -> str:
    """The code that runs case ``name`` again, prints its result and exits 1 when it found a problem."""
    return "\n".join(["from pathlib import Path",
                      "from harness.load.edges import run_edges",
                      f"r = run_edges({binary_expr}, names=({name!r},))[0]",
                      "print(r.to_json())",
                      "raise SystemExit(1 if r.problems else 0)"])  # fmt: skip


