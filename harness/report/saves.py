"""One prompt save measured three ways, master against shared (PR #27451), and what each side costs.

The save (``server_slot::prompt_save``, tools/server/server-context.cpp:258 @ 0c1e570) of a slot that
holds ``n`` context checkpoints of ``c`` bytes each (C = n c) and a state of S bytes: master deep-copies
the checkpoints into the new cache entry (its transient peak is S + C), the PR shares them (S). The
model's logical ``--cache-ram`` charge is S + C in both. The models are :data:`fixtures.gguf.BIG_SPECS`'
``mamba-big`` family (one slot's recurrent state, and so each checkpoint, is 4 x 512 x (d_state + 3)
x 4 bytes: 88 KiB to 64 MiB), driven the way :func:`harness.backends.llama_server.save_peak` drives
``mamba-big``: a prompt extended by 40 tokens per request leaves up to two checkpoints per request,
then the save (:data:`BASE` is 160 tokens where save_peak's is 600; :func:`server_point` runs
save_peak's own requests).

Layers (one word each, also the keys of ``report.json``):

* ``model``: the reference model's ledger (:class:`harness.model.memory.Host`) on real libllama
  contexts: the physical bytes the save adds at its peak, exact.
* ``llama``: the same save in this process under ``memray.Tracker(native_traces=True)``: the heap's
  high-water mark during the save, libllama's own allocations included. The harness adds two copies of
  S that the C++ server does not make (libllama writes into a ctypes buffer that becomes Python bytes,
  beside the entry's zero-filled buffer), so its theory line is the model's plus 2 S (``harness_copies``).
* ``server``: a real ``llama-server`` (:class:`harness.backends.llama_server.Differential`, the model fed
  the same requests): VmHWM - VmRSS around the request whose slot selection makes the save (VmHWM reset
  with ``5 > /proc/PID/clear_refs`` right before). That request also processes its own prompt after the
  save, and the context checkpoints it creates on the way are held next to the saved entry under the PR
  (the slot's old ones are not freed, the entry holds them) while master frees the slot's copies first:
  the model predicts the whole request (``predicted_request_bytes``) as well as the save alone
  (``predicted_bytes``), and the difference is the named line ``request_checkpoint_bytes``.

Time: a row's ``save_seconds`` is the first save after the build-up (``prompt_save`` alone: on the server
from slot selection to the cache lookup that follows the save, read from its log at ``-lv 4``). Whether
that save's S-sized buffers land on fresh pages is the heap's history: on a VM each fresh page costs a
minor fault (~13 us on the host of 2026-12-03), so a 1 MiB state adds ~3 ms or nothing, and the more
memory the process holds the likelier the fresh pages. :func:`warm_saves` times more saves of the same
prompt in the steady state of a server whose clients come back (the buffers the last restore freed);
every row says its minor faults (``minflt``, ``warm_minflt``).

:func:`save_curve` is the one entry point other modules call (the bench's payload-size axis too);
:func:`update_cost` (libllama, the model) and :func:`server_update_cost` (llama-server, speculative
decoding) measure the PR's price, a fresh buffer for every checkpoint update where master resizes a
same-size vector in place (common/common.cpp:2288 @ 0c1e570); :func:`charge_run` follows the logical
``--cache-ram`` charge against physical bytes over a run of requests.

Size: ``_server_point`` drives one server through the build-up, the measured request and the log and
/proc readings that explain it, in order; splitting it would pass half a dozen locals around.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import re
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import memray

from fixtures.gguf import SIZED_D_STATES, draft_path, model_path, sized_model_name
from harness.backends.llama_server.differential import Differential
from harness.errors import EXIT_USAGE, HarnessError, UsageError
from harness.model.checkpoint import CommonPromptCheckpoint
from harness.model.memory import Host
from harness.model.provider import STATE_SEQ_FLAGS_PARTIAL_ONLY, MemoryKind, SyntheticProvider
from harness.model.semantics import get_semantics
from harness.model.server_context import ServerContext, ServerParams
from harness.targets.libllama import LlamaProvider, close_server, load_model, make_llama_server
from harness.targets.llama_server import Launch, ServerConfig, ServerProcess, proc_status

__all__ = [
    "BASE",
    "FIXED_MMAP_THRESHOLD",
    "LAYERS",
    "allocator_control",
    "charge_run",
    "checkpoint_size",
    "diverging",
    "main",
    "model_save_point",
    "proc_status",
    "save_curve",
    "server_point",
    "server_update_cost",
    "size_model",
    "synthetic_server",
    "timed_save",
    "update_cost",
    "warm_saves",
]

LAYERS = ("model", "llama", "server")
MIB = 1 << 20
BASE = [3 + (i * 7) % 250 for i in range(160)]  # the build-up's first prompt (save_peak's 600 tokens, shortened)
GATE_BASE = [3 + (i * 7) % 250 for i in range(600)]  # save_peak's (harness/backends/llama_server.py _build_up)
_EXT = [3 + (i * 11) % 250 for i in range(40 * 140)]  # the build-up's extensions: up to 276 checkpoints


def diverging(n: int) -> list[int]:
    """A prompt of ``n`` tokens sharing nothing with :data:`BASE`: the request that makes the slot save.

    On the server it is processed after the save in the same request; with ``n_ubatch`` 64 it leaves
    two checkpoints for n >= 69 (at n - 68 and n - 4), one for 5 <= n < 69, none for n <= 4
    (server-context.cpp:3540-3615 @ 0c1e570: checkpoint offsets {4 + n_ubatch, 4}, none before the
    first batch is decoded).
    """
    return [200 + (i * 3) % 50 for i in range(n)]


def checkpoint_size(d_state: int) -> int:
    """Bytes of one mamba-big-style checkpoint (PARTIAL_ONLY state of one sequence): n_layer x d_inner x
    (d_state + d_conv - 1) x f32, plus libllama's headers (124 bytes, as measured on mamba-big)."""
    return 4 * 512 * (d_state + 3) * 4 + 124


def size_model(nbytes: int) -> str:
    """The sized model whose checkpoint is nearest ``nbytes`` (on a log scale)."""
    if nbytes <= 0:
        raise UsageError(f"checkpoint size must be positive, got {nbytes}")
    d = min(SIZED_D_STATES, key=lambda d: abs(math.log(checkpoint_size(d) / nbytes)))
    return sized_model_name(d)


def _cfg(arch: str, n_checkpoints: int) -> ServerConfig:
    # the build-up's last prompt must fit (a recurrent model's state does not grow with n_ctx)
    n_ctx = max(4096, len(BASE) + 40 * _n_extend(n_checkpoints) + 512)
    return ServerConfig(
        arch,
        n_parallel=1,
        cache_ram_mib=1 << 16,  # 64 GiB: no eviction while measuring
        ctx_checkpoints=n_checkpoints,
        checkpoint_min_step=16,
        n_ctx=n_ctx,
        n_batch=256,
        n_ubatch=64,
        log_verbosity=4,  # the cache lookup's trace line ends a save's time (_save_seconds)
    )


def _n_extend(n_checkpoints: int) -> int:
    """Requests of the build-up: each leaves up to two checkpoints; one more to fill the list."""
    return n_checkpoints // 2 + 2


def _row(layer: str, sem: str, arch: str, n_ckpt: int, c_bytes: int, s_bytes: int, rep: int) -> dict[str, Any]:
    return {
        "layer": layer,
        "semantics": sem,
        "model": arch,
        "rep": rep,
        "n_checkpoints": n_ckpt,
        "checkpoint_bytes": c_bytes,  # C: all the checkpoints the saved slot holds
        "checkpoint_size": c_bytes // n_ckpt if n_ckpt else 0,  # c: one of them
        "state_bytes": s_bytes,  # S
        "theory_bytes": s_bytes + c_bytes if sem == "master" else s_bytes,
        "logical_bytes": s_bytes + c_bytes,  # the --cache-ram charge, the same in both semantics
    }


def synthetic_server(semantics: str, n: int, checkpoint_bytes: int = MIB) -> ServerContext:
    """The model's server on a recurrent synthetic context whose state (and so each checkpoint) is
    ``checkpoint_bytes``, its one slot holding ``n`` checkpoints: S is fixed and n grows, as on the
    ``counts`` axis of this module. Requests extending one prompt by 16 tokens leave up to two
    checkpoints each (near the prompt's end)."""
    params = ServerParams(
        n_slots=1, cache_ram=-1, cache_idle_slots=False, n_ctx_checkpoints=n, checkpoint_min_step=4,
        n_batch=8, n_ubatch=8,
    )  # fmt: skip
    sem = get_semantics(semantics)
    tgt = SyntheticProvider(MemoryKind.RECURRENT, n_seq=1, n_ctx=1 << 16, rs_bytes=checkpoint_bytes)
    server = (sem.server_cls or ServerContext)(params, Host(), sem, tgt, None)
    slot = server.slots[0]
    tokens = [1]
    for _ in range(n):  # bounded: at least one checkpoint per request
        if len(slot.prompt.checkpoints) >= n:
            break
        tokens += [3 + (len(tokens) * 7 + j) % 200 for j in range(16)]
        server.handle_completion(tuple(tokens), n_predict=1)
        server.run_until_idle()
    return server


def model_save_point(semantics: str, total_bytes: int, checkpoint_bytes: int = MIB, warm: int = 0) -> dict[str, Any]:
    """One save on the model's ledger of a slot holding ``total_bytes`` of checkpoints, ``checkpoint_bytes`` each
    (:func:`synthetic_server`): ``prompt_save`` into an empty cache, timed, and ``warm`` more saves of the
    same prompt (:func:`warm_saves`). Returns the row shape of :func:`save_curve` (``save_seconds``,
    ``peak_bytes``, ``warm_save_seconds``, ...).
    """
    server = synthetic_server(semantics, max(1, total_bytes // checkpoint_bytes), checkpoint_bytes)
    slot = server.slots[0]
    cache = server.prompt_cache
    assert cache is not None
    c = sum(ck.size() for ck in slot.prompt.checkpoints)
    n_ckpt = len(slot.prompt.checkpoints)
    ok, dt, flt = timed_save(slot.prompt_save, cache)
    op = server.host.last_op
    assert ok and op is not None and op.name == "save"
    row = {
        "layer": "model",
        "semantics": semantics,
        "n_checkpoints": n_ckpt,
        "checkpoint_bytes": c,
        "state_bytes": op.state_bytes,
        "peak_bytes": op.peak_excess,
        "save_seconds": dt,
        "minflt": flt,
    }
    if warm:
        row.update(warm_saves(server, warm))
    return row


def _model_server(sem: str, arch: str, n_checkpoints: int) -> ServerContext:
    cfg = _cfg(arch, n_checkpoints)
    server = make_llama_server(sem, model_path(arch), params=cfg.params(), n_ctx=cfg.n_ctx, check_restores=False)
    try:
        for k in range(_n_extend(n_checkpoints)):
            server.handle_completion(tuple(BASE + _EXT[: 40 * k]), id_slot=0, n_cmpl=1, n_predict=1)
            server.run_until_idle()
    except BaseException:
        close_server(server)
        raise
    return server


def _llama_point(
    sem: str, arch: str, n_checkpoints: int, rep: int, traced: bool, capture: Path | None, warm: int = 0
) -> list[dict[str, Any]]:
    """The ``model`` row (and with ``traced`` the ``llama`` row) of one save on real libllama contexts;
    with ``warm``, both rows also get :func:`warm_saves` (``warm_save_seconds``, ``warm_minflt``)."""
    server = _model_server(sem, arch, n_checkpoints)
    try:
        slot, cache = server.slots[0], server.prompt_cache
        assert cache is not None
        ckpts = list(slot.prompt.checkpoints)
        c_bytes = sum(c.size() for c in ckpts)
        if traced:
            assert capture is not None
            capture.parent.mkdir(parents=True, exist_ok=True)
            capture.unlink(missing_ok=True)
            with memray.Tracker(str(capture), native_traces=True):
                ok, dt, flt = timed_save(slot.prompt_save, cache)
        else:
            ok, dt, flt = timed_save(slot.prompt_save, cache)
        op = server.host.last_op
        assert ok and op is not None and op.name == "save", f"{arch} {sem}: the save did not happen"
        s_bytes = op.state_bytes
        model = _row("model", sem, arch, len(ckpts), c_bytes, s_bytes, rep)
        model.update(
            peak_bytes=op.peak_excess, save_seconds=None if traced else dt, allocations=op.allocations, minflt=flt
        )
        rows = [model]
        if traced:
            assert capture is not None
            meta = memray.FileReader(str(capture)).metadata
            llama = _row("llama", sem, arch, len(ckpts), c_bytes, s_bytes, rep)
            llama.update(
                peak_bytes=int(meta.peak_memory),
                save_seconds=dt,  # under memray's native tracing
                predicted_bytes=op.peak_excess,
                harness_copies=2 * s_bytes,
                theory_bytes=llama["theory_bytes"] + 2 * s_bytes,
                allocations=int(meta.total_allocations),
                capture=capture.name,
                minflt=flt,
            )
            rows.append(llama)
        if warm:
            w = warm_saves(server, warm)  # untraced: memray's hooks would be timed too
            for r in rows:
                r.update(w)
        return rows
    finally:
        close_server(server)


_TS = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) ")


def _log_seconds(line: str) -> float | None:
    m = _TS.match(line)
    if m is None:
        return None
    mi, s, ms, us = (int(x) for x in m.groups())  # common/log.cpp: minutes.seconds.milliseconds.microseconds
    return mi * 60 + s + ms / 1e3 + us / 1e6


def _save_seconds(log: str, since: int) -> float | None:
    """From the server's log after offset ``since``: slot selection to the cache lookup that follows the
    save, so ``prompt_save`` alone (server-context.cpp:1617-1627 @ 0c1e570; the lookup's first line is
    server-task.cpp:1799). None when the log has no such pair (the save was skipped)."""
    t_sel = t_look = None
    for line in log[since:].splitlines():
        if t_sel is None and "selected slot by" in line:
            t_sel = _log_seconds(line)
        elif t_sel is not None and "looking for better prompt" in line:
            t_look = _log_seconds(line)
            break
    return None if t_sel is None or t_look is None else round(t_look - t_sel, 6)


def timed_save(save: Callable[[Any], bool], cache: Any) -> tuple[bool, float, int]:
    """``save(cache)`` (a slot's ``prompt_save``): whether it saved, its seconds and this process's minor
    page faults during it."""
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    ok = bool(save(cache))
    dt = time.perf_counter() - t0
    return ok, dt, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def warm_saves(server: ServerContext, warm: int) -> dict[str, list[Any]]:
    """``warm`` more saves of slot 0's prompt P, each timed in the steady state of a server that saved it
    and restored it before: requests alternate P (restored from the cache, whose load erases the entry)
    and :func:`diverging` D (its slot selection saves P again), as on a server whose clients come back.

    The first save after a build-up lands on whatever pages the allocator has: on a VM, fresh pages
    cost a minor fault each (~13 us here), and whether the S-sized buffers are fresh is the heap's
    history, not the save's bytes. Every warm save reuses the buffers the last restore freed. Returns
    the row fields ``warm_save_seconds``, ``warm_minflt`` and ``warm_checkpoint_bytes`` (each save's C,
    to show it is the same payload), one entry per save, as :func:`_server_warm` does. Call it right
    after the build-up's save, while the slot holds P; raises :class:`UsageError` if the cycle saved P
    fewer than ``warm`` times (bounded: ``warm`` + 2 cycles)."""
    slot = server.slots[0]
    p = tuple(slot.prompt.tokens)
    d = tuple(diverging(300))
    out: dict[str, list[Any]] = {"warm_save_seconds": [], "warm_minflt": [], "warm_checkpoint_bytes": []}
    orig = slot.prompt_save

    def timed(cache: Any) -> bool:
        is_p = tuple(slot.prompt.tokens[: len(p)]) == p
        c_bytes = sum(c.size() for c in slot.prompt.checkpoints)
        ok, dt, flt = timed_save(orig, cache)
        if ok and is_p:
            out["warm_save_seconds"].append(dt)
            out["warm_minflt"].append(flt)
            out["warm_checkpoint_bytes"].append(c_bytes)
        return ok

    slot.prompt_save = timed  # type: ignore[method-assign,assignment]
    try:
        for _ in range(warm + 2):  # bounded: one save of P per cycle once the cycle runs
            if len(out["warm_save_seconds"]) >= warm:
                break
            for tokens in (p, d):
                server.handle_completion(tokens, id_slot=0, n_cmpl=1, n_predict=1)
                server.run_until_idle()
    finally:
        del slot.prompt_save
    if len(out["warm_save_seconds"]) < warm:
        raise UsageError(f"the warm saves saved the slot's prompt {len(out['warm_save_seconds'])} of {warm} times")
    return out


# glibc's malloc with a fixed mmap threshold: every allocation >= 64 KiB is its own mapping and goes back to
# the kernel when freed (a fixed threshold also turns off glibc's dynamic threshold, which rises to the size
# of the last freed mapped chunk and then serves such sizes from the heap, where a freed chunk stays resident)
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def allocator_control(binary: Path, semantics: str, log_dir: str | None = None) -> dict[str, Any]:
    """The residual of the one-checkpoint save (``mamba-big``, 300-token prompt after it), measured with
    glibc's default malloc and with :data:`FIXED_MMAP_THRESHOLD`: what the allocator keeps resident."""
    rows = {
        name: _server_point(binary, semantics, "mamba-big", 1, 0, 300, log_dir, env=env)
        for name, env in (("default", None), ("fixed_mmap_threshold", FIXED_MMAP_THRESHOLD))
    }
    c = rows["default"]["checkpoint_size"]
    return {
        "semantics": semantics,
        "checkpoint_size": c,
        "env": FIXED_MMAP_THRESHOLD,
        **{
            f"{name}_residual_checkpoints": round((r["peak_bytes"] - r["predicted_request_bytes"]) / c, 2)
            for name, r in rows.items()
        },
        "rows": rows,
    }


def server_point(binary: Path, semantics: str, *, n_diverging: int = 300, log_dir: str | None = None) -> dict[str, Any]:
    """The gate's own save (:func:`harness.backends.llama_server.save_peak`: ``mamba-big``, 16 checkpoints
    at most, the 600-token prompt extended 8 times), followed by an ``n_diverging``-token prompt."""
    return _server_point(binary, semantics, "mamba-big", 16, 0, n_diverging, log_dir, n_extend=8, base=GATE_BASE)


def _server_point(
    binary: Path,
    sem: str,
    arch: str,
    n_checkpoints: int,
    rep: int,
    n_diverging: int,
    log_dir: str | None,
    *,
    n_extend: int | None = None,
    base: Sequence[int] = BASE,
    env: dict[str, str] | None = None,
    warm: int = 0,
) -> dict[str, Any]:
    """One save on a real llama-server: VmHWM around the request that makes it, and what the model says.
    ``env``: extra environment of the server (the allocator control sets glibc's malloc tunables).
    ``warm``: that many more saves of the same prompt, timed as :func:`warm_saves` does in process."""
    with Differential(_cfg(arch, n_checkpoints), binary, sem, log_dir, env=dict(env or {})) as d:
        prompt: list[int] = []
        for k in range(_n_extend(n_checkpoints) if n_extend is None else n_extend):
            prompt = [*base, *_EXT[: 40 * k]]
            row = d.request(prompt, 1)
            if not row.ok:
                raise UsageError(f"server and model disagree while building up {arch}: {row.describe()}")
        slot = d.model.slots[0]
        ckpts = list(slot.prompt.checkpoints)
        c_bytes = sum(c.size() for c in ckpts)
        saves: list[tuple[int, int]] = []
        orig = slot.prompt_save

        def traced(cache: Any) -> bool:
            ok = orig(cache)
            op = d.model.host.last_op
            if op is not None and op.name == "save":
                saves.append((op.peak_excess, op.state_bytes))
            return ok

        slot.prompt_save = traced  # type: ignore[method-assign,assignment]
        pid = d.server.pid
        text0 = d.server.log_through(0)
        log0, released = len(text0), text0.count("stop processing: n_tokens")
        _reset_hwm(pid)
        before = proc_status(pid)
        with d.model.host.operation("request") as req:
            row = d.request(diverging(n_diverging), 1)
        after = proc_status(pid)
        if not row.ok:
            raise UsageError(f"server and model disagree on the saving request ({arch}): {row.describe()}")
        log = d.server.log_through(released + 1)
        save_peak, s_bytes = saves[0] if saves else (0, 0)
        new_ckpt = sum(c.size() for c in d.model.slots[0].prompt.checkpoints)
        out = _row("server", sem, arch, len(ckpts), c_bytes, s_bytes, rep)
        out.update(
            peak_bytes=after["VmHWM"] - before["VmRSS"],
            save_seconds=_save_seconds(log, log0),
            predicted_bytes=save_peak,
            predicted_request_bytes=req.peak_excess,
            request_checkpoint_bytes=req.peak_excess - save_peak,
            request_checkpoints=len(d.model.slots[0].prompt.checkpoints),
            request_checkpoint_size=new_ckpt,
            n_diverging=n_diverging,
            minflt=after["minflt"] - before["minflt"],
            rss_after_bytes=after["VmRSS"] - before["VmRSS"],
            saved=bool(saves),
        )
        if warm:
            out.update(_server_warm(d, prompt, diverging(n_diverging), warm))
        return out


def _cached(d: Differential, p: list[int]) -> bool:
    cache = d.model.prompt_cache
    return cache is not None and any(list(e.prompt.tokens[: len(p)]) == p for e in cache.states)


def _server_warm(d: Differential, p: list[int], dv: list[int], warm: int) -> dict[str, list[Any]]:
    """``warm`` more saves of ``p`` on ``d``'s server (the :func:`warm_saves` cycle: request ``p``, restored
    from the cache, then ``dv``, whose slot selection saves it), each timed from the server's log; the
    server's minor faults are those of the whole ``dv`` request. The model must agree on every request."""
    out: dict[str, list[Any]] = {"warm_save_seconds": [], "warm_minflt": [], "warm_checkpoint_bytes": []}
    for _ in range(warm + 2):  # bounded: one save of p per cycle once the cycle runs
        if len(out["warm_save_seconds"]) >= warm:
            break
        for tokens in (p, dv):
            slot = d.model.slots[0]
            is_p = tokens is dv and list(slot.prompt.tokens[: len(p)]) == p and not _cached(d, p)
            c_bytes = sum(c.size() for c in slot.prompt.checkpoints)
            text0 = d.server.log_through(0)
            log0, released = len(text0), text0.count("stop processing: n_tokens")
            before = proc_status(d.server.pid)
            row = d.request(tokens, 1)
            after = proc_status(d.server.pid)
            if not row.ok:
                raise UsageError(f"server and model disagree in the warm saves: {row.describe()}")
            dt = _save_seconds(d.server.log_through(released + 1), log0)
            if is_p and dt is not None and _cached(d, p):  # the model saved p: so did the server it agrees with
                out["warm_save_seconds"].append(dt)
                out["warm_minflt"].append(after["minflt"] - before["minflt"])
                out["warm_checkpoint_bytes"].append(c_bytes)
    if len(out["warm_save_seconds"]) < warm:
        raise UsageError(f"the server's warm saves saved the prompt {len(out['warm_save_seconds'])} of {warm} times")
    return out


def save_curve(
    layer: str,
    semantics: str,
    *,
    counts: Sequence[int] = (),
    sizes: Sequence[int] = (),
    reps: int = 1,
    n_checkpoints: int = 4,
    size: int = 1 << 20,
    binary: Path | None = None,
    capture_dir: Path | None = None,
    log_dir: str | None = None,
    n_diverging: int = 300,
    warm: int = 0,
    progress: Callable[[str], None] = lambda _m: None,
) -> list[dict[str, Any]]:
    """Transient peak and time of one save, per point, on ``layer`` (``model``, ``llama`` or ``server``).

    ``counts``: numbers of checkpoints (the checkpoint size fixed at the model nearest ``size`` bytes);
    ``sizes``: checkpoint sizes in bytes, each mapped to the nearest sized model (the row says the size
    it got), with ``n_checkpoints`` checkpoints. Each point is measured ``reps`` times. Every row has
    ``layer, semantics, model, rep, n_checkpoints, checkpoint_bytes, checkpoint_size, state_bytes,
    theory_bytes, logical_bytes, peak_bytes, save_seconds, minflt`` and the layer's own fields (the module
    doc). ``save_seconds`` is the first save after the build-up; with ``warm`` > 0 each row also has that
    many more saves of the same prompt in a steady heap (:func:`warm_saves`): ``warm_save_seconds``,
    ``warm_minflt``, ``warm_checkpoint_bytes``. ``server`` needs ``binary`` (a llama-server of
    ``semantics``); ``llama`` keeps its memray captures in ``capture_dir`` (a temporary name otherwise
    overwritten). ``semantics`` is ``master`` or ``shared``.
    """
    if layer not in LAYERS:
        raise UsageError(f"unknown layer {layer!r}; choose one of {', '.join(LAYERS)}")
    get_semantics(semantics)
    if layer == "server" and binary is None:
        raise UsageError("the server layer needs a llama-server binary")
    points = [(size_model(size), n) for n in counts] + [(size_model(s), n_checkpoints) for s in sizes]
    rows: list[dict[str, Any]] = []
    for (arch, n), rep in ((p, r) for p in points for r in range(reps)):
        progress(f"{layer} {semantics}: {arch}, {n} checkpoints, rep {rep}")
        if layer == "server":
            assert binary is not None
            rows.append(_server_point(binary, semantics, arch, n, rep, n_diverging, log_dir, warm=warm))
            continue
        cap = (capture_dir or Path("/tmp")) / f"save-{semantics}-{arch}-n{n}-r{rep}.bin"
        got = _llama_point(semantics, arch, n, rep, layer == "llama", cap, warm)
        rows.append(got[-1])
    return rows


def _family(k: int, n: int = 200) -> list[int]:
    """Prompt family ``k``: its first token differs from every other family's, so no two share a prefix."""
    return [3 + k] + [3 + (i * (2 * k + 5)) % 250 for i in range(n - 1)]


CHARGE_REQUESTS = (0, 1, 2, 3, 1, 4, 5, 0, 6, 3)  # families: new ones, then revisits (cache hits or misses)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
    )]  # fmt: skip


def heap_in_use() -> int:
    """Bytes this process holds from malloc (glibc ``mallinfo2``: in-use chunks of every arena plus
    mmapped blocks): libllama's and CPython's large buffers alike. 0 where glibc lacks mallinfo2."""
    fn = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if fn is None:
        return 0
    fn.restype = _Mallinfo2
    m = fn()
    return int(m.uordblks + m.hblkhd)


def _reset_hwm(pid: int) -> None:
    """Reset VmHWM to the current VmRSS (``5 > /proc/PID/clear_refs``)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def charge_run(
    semantics: str,
    *,
    binary: Path | None = None,
    arch: str = "mamba-big",
    cache_ram_mib: int = 8,
    log_dir: str | None = None,
    progress: Callable[[str], None] = lambda _m: None,
) -> list[dict[str, Any]]:
    """The logical ``--cache-ram`` charge against physical bytes over a run of requests, evictions marked.

    One slot, ``--cache-ram cache_ram_mib``, requests of :data:`CHARGE_REQUESTS` (200-token prompts of
    distinct families, some revisited): each new family saves the slot's last prompt into the cache. After
    each request: the model's ``cache.size()`` (logical, what the limit is checked against), the unique
    payload bytes the cache's entries hold (physical: a payload shared by two holders counts once), all the
    payload bytes alive (cache and slot) at the end of the request and at its peak, the evictions so far;
    with ``binary`` also the real server's VmRSS and VmHWM (reset before each request) over its VmRSS after
    the first request, and the evictions its log reports. The libllama layer is this process (the model's
    server logic on real libllama contexts, the cache's payloads real buffers): its malloc heap in use
    (:func:`heap_in_use`) and its VmHWM (reset before each request), both over their values after the
    first request.
    """
    cfg = _cfg(arch, 4)
    cfg = ServerConfig(**{**cfg.__dict__, "cache_ram_mib": cache_ram_mib})
    rows: list[dict[str, Any]] = []
    d = Differential(cfg, binary, semantics, log_dir) if binary is not None else None
    model = (
        d.model
        if d is not None
        else make_llama_server(semantics, model_path(arch), params=cfg.params(), n_ctx=cfg.n_ctx, check_restores=False)
    )
    try:
        if d is not None:
            d.server.start()
        rss0: int | None = None
        heap0: int | None = None
        for i, fam in enumerate(CHARGE_REQUESTS):
            progress(f"charge {semantics}: request {i + 1}/{len(CHARGE_REQUESTS)}")
            row: dict[str, Any] = {"request": i, "family": fam, "semantics": semantics}
            gc.collect()  # another run's cyclic garbage freed now, not in the middle of this one's readings
            with model.host.operation("request") as op:
                if d is not None:
                    _reset_hwm(d.server.pid)
                    r = d.request(_family(fam), 1)
                    st = proc_status(d.server.pid)
                    rss0 = st["VmRSS"] if rss0 is None else rss0
                    row.update(
                        server_rss_bytes=st["VmRSS"] - rss0,
                        server_hwm_bytes=st["VmHWM"] - rss0,
                        server_evictions=r.evictions,
                        cache_n=r.cache_n,
                    )
                else:
                    model.handle_completion(tuple(_family(fam)), id_slot=0, n_cmpl=1, n_predict=1)
                    model.run_until_idle()
            gc.collect()
            heap = heap_in_use()
            heap0 = heap if heap0 is None else heap0
            # libllama: this process runs the model's server logic on real contexts, its cache real buffers
            row["llama_heap_bytes"] = heap - heap0
            cache = model.prompt_cache
            assert cache is not None
            unique = {p.ident: p.nbytes for e in cache.states for p in e.payloads()}
            row.update(
                logical_bytes=cache.size(),
                unique_bytes=sum(unique.values()),
                live_bytes=model.host.ledger.live_bytes,
                peak_live_bytes=op.peak,
                entries=len(cache.states),
                evictions=cache.evictions,
            )
            rows.append(row)
        return rows
    finally:
        if d is not None:
            d.close()
        else:
            close_server(model)


def update_cost(
    semantics: str, *, arch: str = "mamba-big", n_updates: int = 32, capture: Path | None = None
) -> dict[str, Any]:
    """What one checkpoint update costs: ``common_prompt_checkpoint::update_tgt`` on real libllama state.

    Master resizes the checkpoint's vector to the same size and reads the state into it (no allocation
    of the payload after the first update); the PR allocates a fresh shared buffer every time and drops
    the old one (common/common.cpp:2288 @ 0c1e570 and fixtures/pr-27451.patch). ``n_updates`` updates of
    one checkpoint on a context that decoded 64 tokens: the model's count of payload allocations and
    bytes, time and minor page faults per update (getrusage), and with ``capture`` memray's count of
    allocations and bytes (native traces) in a second, traced run. Both sides read the state through
    ctypes into Python bytes, which costs the same allocations in both; the difference is the PR's.
    """
    sem = get_semantics(semantics)
    model = load_model(model_path(arch))
    with LlamaProvider(model, name="tgt", n_seq=1, n_ctx=1024, n_batch=256, n_ubatch=64) as ctx:
        if ctx.decode(0, [3 + (i * 7) % 250 for i in range(64)], 0) != 0:
            raise UsageError(f"{arch}: decode failed")
        host = Host()
        ckpt = CommonPromptCheckpoint(host, sem)
        ckpt.update_tgt(ctx, 0, STATE_SEQ_FLAGS_PARTIAL_ONLY)  # the first one allocates in both
        size = ckpt.size()
        live0 = host.ledger.live_bytes
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        with host.operation("update") as op:
            t0 = time.perf_counter()
            for _ in range(n_updates):
                ckpt.update_tgt(ctx, 0, STATE_SEQ_FLAGS_PARTIAL_ONLY)
            dt = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        out: dict[str, Any] = {
            "semantics": semantics,
            "model": arch,
            "checkpoint_size": size,
            "n_updates": n_updates,
            "model_allocations_per_update": op.allocations / n_updates,
            "model_bytes_per_update": op.allocations * size / n_updates,
            "model_peak_excess_bytes": op.peak - live0,
            "seconds_per_update": dt / n_updates,
            "minflt_per_update": (ru1.ru_minflt - ru0.ru_minflt) / n_updates,
        }
        if capture is not None:
            capture.parent.mkdir(parents=True, exist_ok=True)
            capture.unlink(missing_ok=True)
            with memray.Tracker(str(capture), native_traces=True):
                for _ in range(n_updates):
                    ckpt.update_tgt(ctx, 0, STATE_SEQ_FLAGS_PARTIAL_ONLY)
            reader = memray.FileReader(str(capture))
            n_alloc = n_bytes = big = 0
            for rec in reader.get_allocation_records():
                if memray.AllocatorType(rec.allocator).name in ("FREE", "MUNMAP", "PYMALLOC_FREE"):
                    continue
                n_alloc += rec.n_allocations
                n_bytes += rec.size
                big += rec.size >= size // 2
            out.update(
                memray_allocations_per_update=n_alloc / n_updates,
                memray_bytes_per_update=n_bytes / n_updates,
                memray_large_allocations_per_update=big / n_updates,
                capture=capture.name,
            )
        ckpt.destroy()
        return out


def server_update_cost(
    binary: Path, semantics: str, *, arch: str = "mamba-big", n_predict: int = 96, log_dir: str | None = None
) -> dict[str, Any]:
    """The same cost on a real llama-server: speculative decoding with the draft model on ``arch``.

    Every draft round updates the slot's speculative checkpoint of the target (``spec_ckpt.update_tgt``,
    server-context.cpp:3029-3065 @ 0c1e570; mamba's memory cannot roll back, so the checkpoint is taken):
    master reuses the vector, the PR allocates a fresh 1 MiB buffer. One warm-up request, then one of
    ``n_predict`` tokens; the server's minor page faults (/proc/PID/stat) and time per generated token and
    per drafted token, and VmHWM growth, around that request.
    """
    get_semantics(semantics)
    log = None if log_dir is None else Path(log_dir) / f"update-{semantics}-{arch}.log"
    srv = ServerProcess(
        binary,
        Launch(
            model=model_path(arch),
            draft=draft_path(),
            n_parallel=1,
            ctx_size=2048,
            cache_ram=0,
            ctx_checkpoints=4,
            args=["-b", "256", "-ub", "64", "--no-warmup"],
        ),
        log_path=log,
    )
    with srv:
        srv.completion(diverging(40), 8, ignore_eos=True)
        pid = srv.pid
        _reset_hwm(pid)
        before = proc_status(pid)
        t0 = time.perf_counter()
        r = srv.completion(BASE[:100], n_predict, ignore_eos=True)
        dt = time.perf_counter() - t0
        after = proc_status(pid)
    timings = r.get("timings") or {}
    drafted = int(timings.get("draft_n", 0))
    n = int(timings.get("predicted_n", n_predict)) or n_predict
    faults = after["minflt"] - before["minflt"]
    return {
        "semantics": semantics,
        "model": arch,
        "n_predict": n,
        "draft_n": drafted,
        "draft_n_accepted": int(timings.get("draft_n_accepted", 0)),
        "server_minflt": faults,
        "server_minflt_per_token": faults / n,
        "server_ms_per_token": 1e3 * dt / n,
        "server_hwm_growth_bytes": after["VmHWM"] - before["VmRSS"],
    }


def main(argv: Sequence[str]) -> int:
    """``python -m harness.report.saves LAYER SEMANTICS N REP WARM``: one point of the bench's ``saves``
    case (``model`` or ``llama``, N checkpoints of about 1 MiB) in a fresh interpreter, its rows as JSON on
    the last line of stdout. Every size is then measured from the same process state, as the server
    layer's points are (a fresh llama-server each): a process that held 256 MiB of checkpoints a moment
    ago has another heap (:func:`harness.bench.cases.save_layers`)."""
    if (
        len(argv) != 5
        or argv[0] not in ("model", "llama")
        or argv[1] not in ("master", "shared")
        or not all(a.isdigit() for a in argv[2:])
    ):
        print("usage: python -m harness.report.saves {model,llama} {master,shared} N REP WARM", file=sys.stderr)
        return EXIT_USAGE
    layer, sem, (n, rep, warm) = argv[0], argv[1], (int(a) for a in argv[2:])
    try:
        if layer == "model":
            rows = [model_save_point(sem, n * MIB, warm=warm)]
        else:
            rows = save_curve("llama", sem, counts=[n], size=MIB, warm=warm)
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    for r in rows:
        r["rep"] = rep
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
