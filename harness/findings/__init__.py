"""The one registry of known findings: suspected upstream bugs the gate reports and does not fail on.

A :class:`Finding` names the property it violates, the backend that sees it, where upstream's code
is at fault (file:line at 0c1e570 unless said otherwise) and, where one exists, the standalone
reproducer under ``fixtures/findings/`` that exits 1 while the bug is present. Each backend decides
*whether* a run shows a finding (matched by the violated property and the state that makes it, never
by a broad tolerance); this table says *what* each one is, once. :class:`KnownRow` is a run's row of one
(``known_findings`` in the gate's JSON). The contract machine's findings also say where upstream is
at fault (``upstream``) and the state that shows them (:class:`ContractCondition`).

The rows live by backend in this package's modules (``synthetic``, ``libllama``, ``server``,
``lcp_caches``); the record types in ``record``. Imports nothing of the project outside it: every
floor may use it.
"""

from __future__ import annotations

from harness.findings.lcp_caches import LCP_CACHES
from harness.findings.libllama import LIBLLAMA
from harness.findings.record import ContractCondition, Finding, KnownRow
from harness.findings.server import SERVER
from harness.findings.synthetic import SYNTHETIC

__all__ = ["BATCH_SHAPE_FLIP_GAP", "FINDINGS", "ContractCondition", "Finding", "KnownRow", "finding"]

#: Per model, the widest gap a greedy choice can flip across by batch shape alone (issue #41): at the first
#: token a server's answer differs from a fresh single-slot server's, the fresh server's logprob of its best
#: token minus that of the token served. Measured with ``python -m harness trace`` on 51 traced runs of
#: ``python -m harness concurrent`` (seeds 1 and 2, every configuration, ~36,000 logits reads): every
#: replay gave the server's logits bit for bit and no call was inconsistent, and the widest shift of the
#: margin between a fresh evaluation's best token and any of its top 10 was llama 0.179, gemma2 0.077,
#: jamba 0.063, lfm2 0.022 (flash attention's two kernels, ggml-cpu/ops.cpp:9547-9569), mamba 2e-5; the
#: bound is that, rounded up. The flips seen were narrower (0.003-0.039; 0.0142 at most on 2-16 token
#: answers). No entry (mamba: no attention layer): no flip is excused. The one condition under which an
#: output divergence is excused as ``concurrent-output-divergence`` or ``greedy-flip-on-cache-path``.
BATCH_SHAPE_FLIP_GAP: dict[str, float] = {"llama": 0.18, "gemma2": 0.08, "jamba": 0.07, "lfm2": 0.03}

_ALL = [*SYNTHETIC, *LIBLLAMA, *SERVER, *LCP_CACHES]

FINDINGS: dict[str, Finding] = {f.id: f for f in _ALL}
if len(FINDINGS) != len(_ALL):  # one id, one finding: a second row under an id would silently win
    raise RuntimeError(f"duplicate finding ids: {sorted(i for i in FINDINGS if sum(f.id == i for f in _ALL) > 1)}")


def finding(id: str) -> Finding:
    """The registered finding ``id`` (a KeyError names a finding nobody registered: a harness bug)."""
    return FINDINGS[id]
