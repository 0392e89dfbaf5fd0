"""Which request form a ``llama-server`` version answers usably, asked of a throwaway server of it.

The harness drives every server with token-id prompts, ``ignore_eos``, ``return_tokens``, ``cache_prompt``
and ``n_probs``, and reads :data:`NEEDED_FIELDS` from every answer. :func:`probe` checks a binary's version
before anything is measured on it, and records what its completions must carry
(:func:`harness.targets.llama_server.completion_fields`); :func:`agree_forms` makes the servers whose answers
are compared with each other use one form.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fixtures.models import model_path
from harness.errors import RequestFailed, UsageError
from harness.targets.llama_server import ServerProcess, set_completion_fields

__all__ = ["HIGH_BYTES", "NEEDED_FIELDS", "ServerVersion", "agree_forms", "probe"]


HIGH_BYTES = tuple(3 + b for b in range(0x80, 0x100))
"""The fixtures vocabulary's byte tokens ``<0x80>``..``<0xFF>`` (id = 3 + byte): alone, or last in a
generation, they leave the generated text inside (or outside) a UTF-8 sequence."""

_PROBED: dict[tuple[Path, int, int], ServerVersion] = {}

#: what the harness reads from every ``/completion`` answer (:class:`harness.backends` drivers)
NEEDED_FIELDS = ("tokens", "id_slot", "timings.cache_n", "timings.prompt_n")


@dataclass(frozen=True)
class ServerVersion:
    """What :func:`probe` learnt of a ``llama-server`` binary: its build (``/props``), the fields every
    completion must carry for its answers to be usable, and one line per adaptation."""

    binary: Path
    build_info: str
    fields: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def line(self) -> str:
        form = "; ".join(self.notes) if self.notes else "the plain request form"
        return f"llama-server {self.build_info}: {form}"


def agree_forms(versions: Sequence[ServerVersion]) -> dict[str, Any]:
    """One request form for servers whose answers are compared with each other: the union of what each
    version needs (a ban one needs is applied to all), registered for every binary."""
    fields: dict[str, Any] = {}
    for v in versions:
        fields.update(v.fields)
    for v in versions:
        set_completion_fields(v.binary, fields)
    return fields


def _missing(answer: Any) -> list[str]:
    out = []
    for name in NEEDED_FIELDS:
        node = answer
        for part in name.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            out.append(name)
    return out


def probe(binary: Path, *, log: Callable[[str], None] = lambda _m: None) -> ServerVersion:
    """Ask a throwaway ``llama-server`` of ``binary`` (one slot, no cache, the fixtures' llama model) which
    request form its version answers usably, and register it for :meth:`ServerProcess.completion`.

    * ``/props`` gives the build; a ``/completion`` with the harness's fields (token prompt, ``ignore_eos``,
      ``return_tokens``, ``cache_prompt``, ``n_probs``) must answer with :data:`NEEDED_FIELDS`; a refusal
      or a missing field is one :class:`~harness.errors.UsageError` line naming it and the build (exit 2).
    * Some versions parse the generated text with their chat-output parser even on ``/completion`` and
      answer HTTP 500 when a generation ends inside a UTF-8 sequence (llama.cpp of 2026-08, common/chat.cpp
      ``common_chat_peg_parse``: "does not match the expected Content-only format"). The probe forces one
      such token (``logit_bias``); when the server refuses it, every completion of the run bans the 128
      byte tokens that can (:data:`HIGH_BYTES`), on every server whose answers are compared.

    Cached per binary (path, size, mtime) for the life of the process."""
    path = binary.resolve()
    st = path.stat()
    key = (path, st.st_size, st.st_mtime_ns)
    if key in _PROBED:
        set_completion_fields(path, _PROBED[key].fields)
        return _PROBED[key]
    notes: list[str] = []
    fields: dict[str, Any] = {}
    base = {"ignore_eos": True, "return_tokens": True, "n_probs": 2}
    set_completion_fields(path, {})
    with ServerProcess(path, ["--no-warmup"], model=model_path("llama"), n_parallel=1, ctx_size=256,
                       cache_ram=0) as srv:  # fmt: skip
        try:
            props = srv.request("GET", "/props")
        except RequestFailed as e:
            raise UsageError(f"llama-server {path} does not answer GET /props usably ({e}): not a version the "
                             "harness can drive") from None  # fmt: skip
        build_info = str(props.get("build_info") or "(no build_info in /props)") if isinstance(props, dict) else "?"
        log(f"probing llama-server {build_info} for the request form it accepts")
        lead = 3 + 0xC3  # a UTF-8 lead byte: generated alone, the text ends inside a sequence
        prompt = [1, 3 + ord("a"), 3 + ord("b")]
        try:
            answer = srv.completion(prompt, 1, logit_bias=[[lead, 100.0]], **base)
            got = [int(t) for t in answer.get("tokens") or ()]
            if got != [lead]:
                notes.append(f"logit_bias did not force token {lead} (got {got}): its text post-processing is unknown")
        except RequestFailed as e:
            if e.kind != "http" or not e.alive:
                raise
            fields = {"logit_bias": [[t, False] for t in HIGH_BYTES]}
            try:
                answer = srv.completion(prompt, 4, **fields, **base)
            except RequestFailed as e2:
                raise UsageError(f"llama-server {build_info} refuses the harness's request form (prompt as token "
                                 f"ids, {', '.join(base)}, logit_bias): {e2}") from None  # fmt: skip
            notes.append(
                f"a generation ending inside a UTF-8 sequence gets {e.describe().split(': ', 1)[1]}, so every "
                f"completion of this run bans the {len(HIGH_BYTES)} byte tokens 0x80-0xFF (logit_bias)"
            )
        missing = _missing(answer)
        if missing:
            raise UsageError(f"llama-server {build_info} answers /completion without {', '.join(missing)}, which "
                             "the harness reads: not a version it can drive") from None  # fmt: skip
    version = ServerVersion(path, build_info, fields, tuple(notes))
    _PROBED[key] = version
    set_completion_fields(path, fields)
    return version
