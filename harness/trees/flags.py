"""Which of the harness's tree-dependent ``llama-server`` flags a built binary knows, read from its ``--help``.

The harness starts every server with the flags of the pinned tree (0c1e570). Some of them came later than the
oldest builds on the package index, and an older ``llama-server`` refuses to start with one it does not know
(``error: invalid argument: -cms`` at b9093). :data:`OPTIONAL` lists those flags, each with how many values it
takes and, where the value matters, the values that came with it; :func:`adapt_args` drops from a command line
each one the binary's ``--help`` does not list, so that the server runs with that tree's own fixed behaviour, and
says which it dropped (the server gate prints them once: the model, pinned to 0c1e570, may then differ from that
tree where the flag mattered, e.g. ``checkpoint_policy`` without ``-cms``).

- ``-cms N`` (``--checkpoint-min-step``, common/arg.cpp:1706 at 0c1e570): the least number of tokens between two
  context checkpoints; not in b9093's ``common/arg.cpp``.
- ``--spec-type draft-simple``: the draft model's speculative type; b9093 knows ``--spec-type`` with n-gram types
  only, and a draft model (``-md``) alone turns its draft speculation on.
- ``--no-cache-idle-slots``: the idle-slot pass off.
"""

from __future__ import annotations

import functools
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

__all__ = ["OPTIONAL", "adapt_args", "knows"]

OPTIONAL: dict[str, tuple[int, tuple[str, ...]]] = {
    "-cms": (1, ()),
    "--spec-type": (1, ("draft-simple",)),  # the value must be listed too
    "--no-cache-idle-slots": (0, ()),
}
"""flag -> (values it takes, values that must also appear in ``--help`` for it to be kept)."""


@functools.cache
def _help(binary: str, mtime_ns: int) -> str:
    """``binary --help`` (stdout and stderr); "" when it cannot be run (the server's own start then says why)."""
    try:
        return subprocess.check_output([binary, "--help"], stderr=subprocess.STDOUT, text=True, timeout=60)
    except subprocess.CalledProcessError as e:  # an older build may exit non-zero after printing its usage
        return str(e.output or "")
    except (OSError, subprocess.SubprocessError):
        return ""


def knows(binary: Path, flag: str, value: str | None = None) -> bool:
    """Whether ``binary --help`` lists ``flag`` (and ``value``, when given); True when there is no help to read (a
    binary that cannot say is started as it is given)."""
    try:
        text = _help(str(binary), binary.stat().st_mtime_ns)
    except OSError:
        return True
    if not text:
        return True
    if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
        return False
    return value is None or re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", text) is not None


def adapt_args(binary: Path, args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``args`` without the :data:`OPTIONAL` flags (and their values) that ``binary`` does not know, and those
    dropped, each as it was given (``"-cms 64"``)."""
    kept: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i]
        if flag in OPTIONAL:
            n, needed = OPTIONAL[flag]
            values = list(args[i + 1 : i + 1 + n])
            value = values[0] if values else None
            if not knows(binary, flag, value if value in needed else None):
                dropped.append(" ".join([flag, *values]))
                i += 1 + n
                continue
        kept.append(flag)
        i += 1
    return kept, dropped
