"""``python -m harness``: see :mod:`harness.cli`.

SIGINT and SIGTERM are taken first (a script's background job inherits SIGINT ignored), and a Ctrl-C
during the imports exits 130 like one during a command.
"""

import sys

from harness.errors import EXIT_INTERRUPTED
from harness.interrupt import take_signals

take_signals()
try:
    from harness.cli import main
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(EXIT_INTERRUPTED)

sys.exit(main())
