"""``python -m harness``: see :mod:`harness.cli`.

SIGINT and SIGTERM are taken first (a script's background job inherits SIGINT ignored), and a Ctrl-C
during the imports exits 130 like one during a command. An interrupted command ends without the
interpreter's teardown (:func:`harness.interrupt.exit_now`).
"""

import sys

from harness.errors import EXIT_INTERRUPTED
from harness.interrupt import exit_now, take_signals

take_signals()
try:
    from harness.cli import main

    rc = main()
except KeyboardInterrupt:  # in the imports, or before main's guard
    print("interrupted", file=sys.stderr)
    rc = EXIT_INTERRUPTED
if rc == EXIT_INTERRUPTED:  # cleaned up and said so: end now, not after the interpreter's teardown
    exit_now(rc)
sys.exit(rc)
