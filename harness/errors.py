"""The one error root of the harness, and the exit codes it carries.

Every error the harness raises on purpose derives from :class:`HarnessError` and carries the exit
code ``python -m harness`` ends with when it escapes a command (:mod:`harness.cli` prints its
message as one line, never a traceback). The codes are the same for every command:

====  ===========================  ==============================================================
0     :data:`EXIT_OK`              everything checked passed
1     :data:`EXIT_FAILED`          a property or trial failed (the output ends with a replay line)
2     :data:`EXIT_USAGE`           usage or environment error: bad flag, missing or corrupt file,
                                   port in use, a server that will not start, unusable database
3     :data:`EXIT_CRASH`           the target crashed (an exception escaped the model, a child or
                                   a server died)
4     :data:`EXIT_BUILD_FAILED`    fetching, patching, configuring or compiling llama-server failed
5     :data:`EXIT_NO_MEMLIMIT`     no memory limit can be set here (no writable cgroup v1 ``memory``
                                   nor cgroup v2 memory controller)
6     :data:`EXIT_SKIPPED`         a layer of the harness cannot run on this tree (a limit of the harness, not
                                   the user's mistake nor the tree's failure): ``ci/fork_gate.sh`` says it
                                   skipped the step, and why, and goes on green
130   :data:`EXIT_INTERRUPTED`     Ctrl-C; children are cleaned up, findings so far are printed
====  ===========================  ==============================================================

The tree, from the root down:

* :class:`UsageError` (2): bad input. :class:`Unavailable` (2): a layer cannot run here (no
  compiler, no ``_testcapi``). :class:`ModelLoadError` (2), :class:`ServerStartError` (2).
* :class:`RequestFailed` (1, or 3 when the server died): a request ``llama-server`` answered with an
  HTTP error, or not at all (connection dropped, no answer in time, not JSON). Its callers classify it
  into a failure with the request sequence that replays it; escaping a command it is one line.
* :class:`BuildError` (4).
* :class:`HarnessLimit` (6): a layer cannot run on this tree for a limit of the harness (the bindings cannot
  drive the tree's libllama): one line naming what to run instead.
* :class:`NoMemoryLimit` (5): a run that needs a real memory limit (``python -m harness oom``) on a
  machine where neither cgroup version's memory controller can be written.
* :class:`PropertyFailure` (1): the one base of every exception that means "a property failed"; it is
  also an ``AssertionError`` so Hypothesis shrinks it like any failed assertion. ``name`` is the
  property (the one attribute for it: a key of ``INVARIANTS`` or a backend's own property), ``message``
  what was seen. Each subclass is raised by one checker, and its failure prints the program that
  replays it; a failure that is a suspected upstream bug becomes a registered finding
  (:mod:`harness.findings`), anything else is a bug to fix where the program shows it:

  - :class:`TargetCrash` (3): the target died (an exception escaped the modelled server).
  - ``properties.invariants.Violation``: a property of the model's machines (synthetic, libllama).
  - ``properties.lcp_machine.LcpViolation``: a property of llama-cpp-python's caches; ``finding``
    names the registered finding it shows, if any.
  - ``properties.libllama_contract.ContractViolation``: libllama's contract, not a known finding.
  - ``harness.backends.llama_server.differential.ServerMismatch``: a llama-server against the model
    (``program``, ``kind``: ``violation`` or ``crash``); its subclass ``change.ChangeFound``: a tree
    answered unlike its base (``--base``).
  - ``harness.load.generated.GeneratedFailure``: a generated request program against a real server
    (``program``: pasteable Python that replays it).
* :class:`UpstreamException` (3): a C++ failure the model reproduces, raised inside the model
  where upstream raises or aborts: :class:`BadAlloc` (``std::bad_alloc``, raised only by the
  allocation seam of :mod:`harness.model.memory`) and :class:`GgmlAbort` (``GGML_ABORT`` /
  ``GGML_ASSERT``). One escaping a ``ServerContext`` operation is a crash of the modelled server:
  upstream has no handler above ``process_single_task``/``update_slots``.

This module imports nothing of the project: everything may import it.
"""

from __future__ import annotations

__all__ = [
    "EXIT_BUILD_FAILED",
    "EXIT_CRASH",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_NO_MEMLIMIT",
    "EXIT_OK",
    "EXIT_SKIPPED",
    "EXIT_USAGE",
    "BadAlloc",
    "BuildError",
    "GgmlAbort",
    "HarnessError",
    "HarnessLimit",
    "ModelLoadError",
    "NoMemoryLimit",
    "PropertyFailure",
    "RequestFailed",
    "ServerStartError",
    "TargetCrash",
    "Unavailable",
    "UpstreamException",
    "UsageError",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CRASH = 3
EXIT_BUILD_FAILED = 4
EXIT_NO_MEMLIMIT = 5
EXIT_SKIPPED = 6
EXIT_INTERRUPTED = 130


class HarnessError(Exception):
    """The root: a one-line message and the exit code a command ends with when this escapes it."""

    exit_code: int = EXIT_USAGE


class UsageError(HarnessError):
    """A bad flag, file or environment: printed as one line, exit code 2."""

    exit_code = EXIT_USAGE


class Unavailable(HarnessError):
    """A fault layer or tool cannot run on this host (no compiler, no ``_testcapi``): one line."""

    exit_code = EXIT_USAGE


class HarnessLimit(HarnessError):
    """A layer of the harness cannot run on this tree (its llama.h lacks a function the harness calls): the harness's
    limit, not the user's mistake (exit 2) nor the tree's failure (exit 1); one line, exit 6, naming what still
    runs on the tree. ``ci/fork_gate.sh`` reports the step as skipped."""

    exit_code = EXIT_SKIPPED


class ModelLoadError(HarnessError):
    """A model file is missing or corrupt, or libllama refused it."""

    exit_code = EXIT_USAGE


class ServerStartError(HarnessError):
    """``llama-server`` did not come up; the message is one line naming the log file and its tail."""

    exit_code = EXIT_USAGE


class RequestFailed(HarnessError):
    """A request to ``llama-server`` that got no usable answer.

    ``kind`` is ``"http"`` (an HTTP error status; ``status`` and the server's ``message``), ``"dropped"``
    (the connection closed or was refused before an answer), ``"timeout"`` (no answer in time) or
    ``"malformed"`` (an answer that is not JSON). ``alive`` says whether the server process was still
    running once the request had failed; ``server_exit`` is its exit code when it was not, and ``log`` its log as
    it ended (when it had one): what it showed before it died.
    """

    exit_code = EXIT_FAILED

    def __init__(
        self,
        method: str,
        path: str,
        kind: str,
        *,
        status: int | None = None,
        message: str = "",
        alive: bool = True,
        server_exit: int | None = None,
        log: str = "",
    ) -> None:
        self.method, self.path, self.kind = method, path, kind
        self.status, self.message, self.alive, self.server_exit = status, message, alive, server_exit
        self.log = log
        if not alive:
            self.exit_code = EXIT_CRASH
        super().__init__(self.describe())

    def describe(self) -> str:
        what = {
            "http": f"HTTP {self.status}" + (f" {self.message!r}" if self.message else ""),
            "dropped": "the connection closed before an answer",
            "timeout": "timed out: no answer in time",
            "malformed": "an answer that is not JSON" + (f" ({self.message})" if self.message else ""),
        }.get(self.kind, self.kind)
        if not self.alive:
            sig = f" = signal {-self.server_exit}" if self.server_exit is not None and self.server_exit < 0 else ""
            what += f"; the server died (exit {self.server_exit}{sig})"
        return f"{self.method} {self.path}: {what}"


class BuildError(HarnessError):
    """Fetching, extracting, patching, configuring or compiling failed; the message is one line."""

    exit_code = EXIT_BUILD_FAILED


class NoMemoryLimit(Unavailable):
    """Neither a cgroup v1 ``memory`` hierarchy nor a cgroup v2 memory controller is writable here: one line
    saying why each is unusable (not root, not mounted, no controller)."""

    exit_code = EXIT_NO_MEMLIMIT


class PropertyFailure(HarnessError, AssertionError):
    """A property does not hold: ``name`` is the property, ``message`` what was seen.

    What to do: run the printed replay line (or paste the shrunk program into ``python`` from the repository
    root) to see it fail again, then fix what it shows, or register it in :mod:`harness.findings` when it is a
    suspected upstream bug the gate should report without failing."""

    exit_code = EXIT_FAILED

    def __init__(self, name: str, message: str, text: str | None = None) -> None:
        super().__init__(text if text is not None else f"[{name}] {message}")
        self.name = name
        self.message = message


class TargetCrash(PropertyFailure):
    """The target would have died (an exception escaped the modelled server): ``name`` is the property.

    The message names the exception; the shrunk program reproduces it. Upstream has no handler there, so the
    fix is in the code the program reaches (or, for upstream's own crash, a registered finding)."""

    exit_code = EXIT_CRASH

    def __init__(self, name: str, message: str) -> None:
        super().__init__(name, message, f"[{name}] target crashed: {message}")


class UpstreamException(HarnessError):
    """A failure mode of the C++ the model reproduces; escaping the model, it is a crash."""

    exit_code = EXIT_CRASH


class BadAlloc(UpstreamException, MemoryError):
    """``std::bad_alloc`` at an armed allocation point.

    ``site`` names the allocation point (``"alloc.state_tgt"``, ``"alloc.ckpt_copy.tgt"``, ...),
    ``nth`` is its 1-based number since the seam was armed.
    """

    def __init__(self, site: str, nth: int, nbytes: int) -> None:
        super().__init__(f"std::bad_alloc at allocation #{nth} ({site}, {nbytes} bytes)")
        self.site = site
        self.nth = nth
        self.nbytes = nbytes


class GgmlAbort(UpstreamException, RuntimeError):
    """``GGML_ABORT``: the upstream process would abort here, with this message."""
