"""The two ownership semantics of checkpoint payloads, chosen by name.

* ``master`` -- llama.cpp as vendored by llama-cpp-python 0.3.36 (commit 0c1e570): the payload
  vectors of ``common_prompt_checkpoint`` are copied by value whenever a checkpoint is copied
  (``server_prompt::clone``, ``server_prompt_cache::alloc``), ``update_tgt``/``update_dft`` resize
  and overwrite the checkpoint's own vector in place, and ``alloc`` catches ``std::bad_alloc`` only
  around the two ``resize`` calls of the new state buffers (server-task.cpp:1762-1777).
* ``shared`` -- PR #27451: ``data_tgt``/``data_dft`` are immutable shared buffers; a copy takes
  a reference; an update allocates a fresh buffer, fills it and swaps the reference; the whole
  entry construction, ``states.push_back`` included, runs inside the ``try``. ``data_spec`` stays
  value-owned, and the logical accounting (``size()``) is unchanged, hence conservative.

A :class:`Semantics` is a small strategy object: the model calls it at exactly these variation
points, so a mutant (``properties.mutants``) is a subclass that overrides one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MASTER", "SEMANTICS", "SHARED", "Semantics", "get_semantics"]


@dataclass(frozen=True)
class Semantics:
    """Which ownership rules the model follows.

    ``shared_payloads``: copies of a checkpoint share ``data_tgt``/``data_dft`` (PR) or deep-copy
    them (master). ``wide_try``: ``alloc`` catches ``bad_alloc`` around the whole entry construction
    (PR) or around the state ``resize`` only (master). The ``*_cls`` fields let a mutant replace
    one model class by a deliberately broken subclass.
    """

    name: str
    shared_payloads: bool
    wide_try: bool
    # classes the model instantiates; a mutant swaps one for a broken subclass (None: the default)
    cache_cls: Any = None
    checkpoint_cls: Any = None
    slot_cls: Any = None
    server_cls: Any = None

    def __str__(self) -> str:
        return self.name


MASTER = Semantics("master", shared_payloads=False, wide_try=False)
SHARED = Semantics("shared", shared_payloads=True, wide_try=True)

SEMANTICS: dict[str, Semantics] = {s.name: s for s in (MASTER, SHARED)}


def get_semantics(name: str) -> Semantics:
    """``"master"`` or ``"shared"``; anything else is a ``ValueError`` naming the choices."""
    try:
        return SEMANTICS[name]
    except KeyError:
        raise ValueError(f"unknown semantics {name!r}: choose one of {', '.join(SEMANTICS)}") from None
