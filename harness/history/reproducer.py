"""``python -m harness.history.reproducer REPRODUCER LLAMA_SERVER``: a finding's reproducer run on one build, its
exit code kept apart from a crash of its own.

A reproducer exits 1 while its bug is present and 0 when it is gone; a Python exception also ends a process with
1. This runs the reproducer's file in this process (``runpy``, ``sys.argv`` as if run directly) and ends any
exception with exit 125 and one line (``git bisect run``'s "cannot test this one"), so
:class:`~harness.history.checks.ReproducerCheck` never reads a traceback as a finding.
"""

from __future__ import annotations

import runpy
import sys

SKIP = 125


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m harness.history.reproducer REPRODUCER LLAMA_SERVER [ARGS...]", file=sys.stderr)
        return 2
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # any end of the reproducer's own: cannot test this build
        print(f"cannot test: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400], file=sys.stderr)
        return SKIP
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
