"""``python -m harness demo``: the seed's central claim, measured on the ledger.

A slot of a hybrid model processes a prompt (creating context checkpoints of C bytes in all),
then saves it into an empty cache with a new state of S bytes. :func:`central_claim` returns, per
semantics, the physical peak of that save above the live bytes before it, and the logical size
charged to the cache. Under ``master`` the peak is S + C (the checkpoints are deep-copied), under
``shared`` it is S, and the logical charge is S + C in both.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from harness.model.server_context import ServerParams
from harness.targets.synthetic import make_server

__all__ = ["ClaimFigures", "add_arguments", "central_claim", "run"]


@dataclass(frozen=True)
class ClaimFigures:
    semantics: str
    state_bytes: int  # S
    checkpoint_bytes: int  # C
    peak_excess: int  # physical peak of the save above the live bytes before it
    logical_charged: int  # what --cache-ram counts for the new entry


def central_claim(semantics: str, *, n_tokens: int = 48, kind: str = "hybrid") -> ClaimFigures:
    params = ServerParams(n_slots=1, cache_ram=-1, cache_idle_slots=False)
    server = make_server(semantics, kind, params=params)
    server.handle_completion(tuple(1 + (i * 7) % 23 for i in range(n_tokens)), n_predict=1)
    server.run_until_idle()
    slot = server.slots[0]
    cache = server.prompt_cache
    assert cache is not None and len(cache) == 0
    c = sum(ck.size() for ck in slot.prompt.checkpoints)
    assert slot.prompt_save(cache)
    op = server.host.last_op
    assert op is not None and op.name == "save"
    return ClaimFigures(semantics, op.state_bytes, c, op.peak_excess, cache.size())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=48, help="prompt length (default 48)")
    parser.add_argument("--kind", default="hybrid", choices=["transformer", "recurrent", "hybrid", "iswa"])
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def run(args: argparse.Namespace) -> int:
    rows = [central_claim(s, n_tokens=args.tokens, kind=args.kind) for s in ("master", "shared")]
    print(f"save of a {args.tokens}-token {args.kind} prompt into an empty cache")
    print(f"{'semantics':<10} {'S (state)':>10} {'C (ckpts)':>10} {'peak excess':>12} {'logical':>9}")
    for r in rows:
        print(
            f"{r.semantics:<10} {r.state_bytes:>10} {r.checkpoint_bytes:>10} {r.peak_excess:>12} {r.logical_charged:>9}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0
