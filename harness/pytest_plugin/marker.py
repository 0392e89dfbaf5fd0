"""``@pytest.mark.prompt_cache_invariants``: the gate's invariants on the modelled servers of a test.

Every server the test makes through the ``modelled_server`` fixture is watched as the gate's state
machine watches its server (:mod:`properties.machine`):

* during the test, the operation post-conditions (``limit``, ``no_partial_entries``,
  ``transient_peak``, ``load_transfer``, ``no_prefix_entries``, ``checkpoint_lists``,
  ``busy_slot_untouched``, ``cleared_checkpoints``) run inside the operations
  (:class:`properties.invariants.Tracer`), and
  the state invariants (``accounting``, ``refcount``, ``checkpoint_lists``, ``draft_in_step``,
  ``immutability``, ``draft_recovery`` when enabled) after every ``handle_completion`` and
  ``update_slots``;
* after the test body, the state invariants once more and then ``refcount`` with every slot and the
  cache cleared (nothing may stay alive).

As in the gate, the states of the two known upstream findings ``swa-checkpoint-order`` and
``stale-checkpoint-after-miss`` are excused. ``strict_peak=False`` records the ``transient_peak``
figures without failing (``master`` exceeds the bound by design: PR #27451's point).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from harness.model.server_context import ServerContext
from properties import invariants as inv

__all__ = ["MARKER", "check_after_test", "check_state", "register_marker", "watch"]

MARKER = "prompt_cache_invariants"


@dataclass
class Watched:
    server: ServerContext
    shadow: inv.Shadow
    tracer: inv.Tracer


_WATCHED = pytest.StashKey[list[Watched]]()


def register_marker(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(strict_peak=True): check the gate's prompt-cache invariants on every server the test makes "
        "through the modelled_server fixture, during and after the test body",
    )


def check_state(server: ServerContext, shadow: inv.Shadow) -> None:
    """The gate's state invariants, with its excuses for the two known upstream findings."""
    inv.check_accounting(server)
    inv.check_refcount(server)
    inv.check_checkpoint_lists(server, excuse_swa_resume=True)
    inv.check_draft_in_step(server, excuse_stale_checkpoint=True)
    shadow.check(server)
    inv.check_restore_equivalence(server)
    if server.params.draft_recovery:
        inv.check_draft_recovery(server)


def _checked_after(server: ServerContext, shadow: inv.Shadow, name: str) -> None:
    inner: Callable[..., Any] = getattr(server, name)

    def checked(*a: Any, **kw: Any) -> Any:
        res = inner(*a, **kw)
        check_state(server, shadow)
        return res

    setattr(server, name, checked)


def watch(item: pytest.Item, server: ServerContext) -> None:
    """Put ``server`` under the invariants if ``item`` carries the marker (else leave it alone)."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return
    shadow = inv.Shadow()
    tracer = inv.Tracer(server, strict_peak=bool(marker.kwargs.get("strict_peak", True)), shadow=shadow)
    for name in ("handle_completion", "update_slots"):
        _checked_after(server, shadow, name)
    item.stash.setdefault(_WATCHED, []).append(Watched(server, shadow, tracer))


def check_after_test(item: pytest.Item) -> None:
    """After a passed test body: the invariants on every server the marked test made (fails the test)."""
    if item.get_closest_marker(MARKER) is None:
        return
    watched = item.stash.get(_WATCHED, [])
    if not watched:
        pytest.fail(
            f"@pytest.mark.{MARKER}: the test made no server through the modelled_server fixture, "
            "so no invariant was checked",
            pytrace=False,
        )
    for i, w in enumerate(watched):
        where = f"modelled server #{i} ({w.server.sem.name})"
        try:
            check_state(w.server, w.shadow)
            w.server.host.seam.disarm()
            inv.clear_all(w.server)
        except inv.Violation as e:
            pytest.fail(f"{MARKER}: {where} after the test: {e}", pytrace=False)
