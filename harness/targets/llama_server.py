"""Run a real ``llama-server`` binary (built by :mod:`harness.trees.build` or anywhere else).

:class:`ServerProcess` starts it on ``127.0.0.1`` and a free port, waits for ``GET /health``, and
always stops it again (context exit, exceptions, Ctrl-C, ``atexit``; the server also dies with the
process that started it). After a Ctrl-C it is SIGKILLed at once rather than asked to stop, and a
second Ctrl-C kills it with the process (:mod:`harness.interrupt`). A server that will not start,
or a port in use, is one :class:`~harness.errors.ServerStartError` line with the tail of the server's log.

:class:`ServerConfig` is one server configuration the harness runs (a fixture gguf's arch and the flags that
matter to the prompt cache), both as the server's flags and as the reference model's parameters. A server's log
is read here too: one log file per server started (:func:`unique_log`), and the sanitizer reports in one log or
a directory of them (:func:`log_sanitizer_reports`, :func:`sanitizer_reports`).

Size: one server's life in one module, its configuration, start, requests, stop and log, so a caller (the server
backend, the load tools, the experiments) imports a server from one place.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from harness.errors import RequestFailed, ServerStartError
from harness.interrupt import check, interrupted, shielded, track, untrack
from harness.model.server_context import ServerParams
from harness.trees.build import build_server, log_tail
from harness.trees.flags import adapt_args
from harness.trees.gcov import SERVER_EXITS_ENV
from harness.trees.stage import sanitizer_first
from harness.trees.switches import PINNED, Switches

__all__ = [
    "SANITIZER_MARKERS",
    "Launch",
    "RequestFailed",
    "ServerConfig",
    "ServerProcess",
    "ServerStartError",
    "Timeouts",
    "completion_fields",
    "completion_form_known",
    "log_sanitizer_reports",
    "proc_status",
    "sampleable",
    "sanitizer_reports",
    "set_completion_fields",
    "unique_log",
    "withheld_tokens",
]


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerConfig:
    """One server configuration: the model and the flags that matter to the prompt cache."""

    arch: str
    n_parallel: int = 2
    kv_unified: bool = False
    cache_ram_mib: int = 1
    ctx_checkpoints: int = 4
    checkpoint_min_step: int = 64
    n_ctx: int = 2048
    n_batch: int = 256
    n_ubatch: int = 64
    draft: bool = False
    log_verbosity: int | None = None  # ``-lv``: 4 logs the prompt cache's trace lines (server-task.cpp:1799)
    cache_idle_slots: bool = True  # False: ``--no-cache-idle-slots`` (no idle-slot pass, common/arg.cpp)

    @property
    def name(self) -> str:
        parts = [self.arch, f"np{self.n_parallel}", "kvu" if self.kv_unified else "kvs"]
        if self.draft:
            parts.append("draft")
        if not self.cache_idle_slots:
            parts.append("noidle")
        return "-".join(parts)

    def server_args(self) -> list[str]:
        return [
            "-cms",
            str(self.checkpoint_min_step),
            "-b",
            str(self.n_batch),
            "-ub",
            str(self.n_ubatch),
            "--no-warmup",
            *(() if self.log_verbosity is None else ("-lv", str(self.log_verbosity))),
            *(() if self.cache_idle_slots else ("--no-cache-idle-slots",)),
        ]

    def params(self, switches: Switches | None = None) -> ServerParams:
        """The model's parameters for this configuration; with ``switches`` (a tree's, :mod:`harness.trees.switches`)
        the model follows that tree's upstream changes too."""
        sw = switches or PINNED
        return ServerParams(
            slot_file_checkpoints=sw.slot_file_checkpoints.on,
            checkpoint_load_bool=sw.checkpoint_load_bool.on,
            idle_pass_needs_unified=sw.idle_pass_needs_unified.on,
            end_checkpoint_spaced=sw.end_checkpoint_spaced.on,
            alloc_without_room=sw.alloc_without_room.on,
            n_slots=self.n_parallel,
            cache_ram=self.cache_ram_mib,
            cache_ram_unit=1 << 20,
            n_ctx_checkpoints=self.ctx_checkpoints,
            checkpoint_min_step=self.checkpoint_min_step,
            kv_unified=self.kv_unified,
            n_batch=self.n_batch,
            n_ubatch=self.n_ubatch,
            n_draft_max=16 if self.draft else 0,
            cache_idle_slots=self.cache_idle_slots,
        )


# --------------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------------


_LIVE: set[ServerProcess] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _stop_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for srv in live:
        with contextlib.suppress(Exception):
            srv.stop()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGKILL the server if the process that started it dies without cleaning up (SIGKILL,
    a CI timeout): atexit does not run then, and the server is in its own process group."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


@dataclass(frozen=True)
class Launch:
    """What a ``llama-server`` is started with: its model and the flags of this llama.cpp version that shape its
    slots and cache (``None``: the server's default), then ``args`` as given.

    ``-m`` ``model``, ``-md`` ``draft`` + ``--spec-type`` (``draft-simple`` unless ``spec_type`` names one),
    ``-np`` ``n_parallel``, ``-c`` ``ctx_size``, ``--cache-ram`` ``cache_ram`` (MiB), ``--ctx-checkpoints``,
    ``--threads``, ``--kv-unified``/``--no-kv-unified``."""

    model: str | os.PathLike[str] | None = None
    draft: str | os.PathLike[str] | None = None
    spec_type: str | None = None
    n_parallel: int | None = None
    ctx_size: int | None = None
    cache_ram: int | None = None
    ctx_checkpoints: int | None = None
    threads: int | None = 1
    kv_unified: bool | None = None
    args: Sequence[str] = ()

    def argv(self) -> list[str]:
        """The server's arguments after ``--host`` and ``--port``."""
        extra: list[str] = []
        if self.model is not None:
            extra += ["-m", os.fspath(self.model)]
        if self.draft is not None:
            # a draft GGUF without speculative metadata is loaded but unused unless a type is named
            extra += ["-md", os.fspath(self.draft), "--spec-type", self.spec_type or "draft-simple"]
        elif self.spec_type is not None:
            extra += ["--spec-type", self.spec_type]
        if self.n_parallel is not None:
            extra += ["-np", str(self.n_parallel)]
        if self.ctx_size is not None:
            extra += ["-c", str(self.ctx_size)]
        if self.cache_ram is not None:
            extra += ["--cache-ram", str(self.cache_ram)]
        if self.ctx_checkpoints is not None:
            extra += ["--ctx-checkpoints", str(self.ctx_checkpoints)]
        if self.threads is not None:
            extra += ["--threads", str(self.threads)]
        if self.kv_unified is not None:
            extra += ["--kv-unified" if self.kv_unified else "--no-kv-unified"]
        return [*extra, *self.args]


@dataclass(frozen=True)
class Timeouts:
    """How long a server may take, in seconds: to answer ``/health`` after its start, to exit after SIGTERM
    (then SIGKILL), to answer one request."""

    startup: float = 120.0
    stop: float = 10.0
    request: float = 300.0


class ServerProcess:
    """A running ``llama-server``; use it as a context manager.

    ``launch`` is what it is started with (:class:`Launch`: the model, the flags of this llama.cpp version,
    ``args`` as given)::

        with ServerProcess(launch=Launch(model=model_path("llama"), n_parallel=2, cache_ram=16, ctx_size=512)) as srv:
            r = srv.completion("Hello", n_predict=4)
            r["timings"]["cache_n"]

    ``binary=None`` builds (or reuses) the pinned tree's build of ``semantics``. ``env`` is merged into the
    environment (e.g. ``{"LD_PRELOAD": shim}``). The server's stdout and stderr go to
    ``log_path`` (a fresh temporary file unless given). ``timeouts``: :class:`Timeouts`. ``preexec`` runs in
    the server's process between ``fork`` and ``exec`` (entering a memory cgroup: :mod:`harness.memlimit`).
    """

    def __init__(
        self,
        binary: str | os.PathLike[str] | None = None,
        launch: Launch | None = None,
        *,
        semantics: str = "shared",
        host: str = "127.0.0.1",
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        timeouts: Timeouts | None = None,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        launch = launch or Launch()
        timeouts = timeouts or Timeouts()
        self._binary = Path(binary) if binary is not None else None
        self._semantics = semantics
        self.launch = launch
        self.host = host
        self.port = port
        self.env = dict(env or {})
        self.startup_timeout = timeouts.startup
        self.stop_timeout = timeouts.stop
        self.request_timeout = timeouts.request
        self.preexec = preexec
        self.log_path = Path(log_path) if log_path is not None else None
        self.dropped: list[str] = []  # flags of the command line this binary does not know (harness.trees.flags)
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopped = False
        self._log_fh: IO[bytes] | None = None
        self.args = launch.argv()
        self._model = Path(launch.model) if launch.model is not None else None
        self._draft = Path(launch.draft) if launch.draft is not None else None

    # -- properties -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("server not started")
        return self.proc.pid

    @property
    def binary(self) -> Path:
        if self._binary is None:
            self._binary = build_server(self._semantics)
        return self._binary

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _fail(self, what: str) -> ServerStartError:
        tail = " | ".join(line.strip() for line in log_tail(self.log_path, 5) if line.strip()) if self.log_path else ""
        return ServerStartError(
            f"llama-server {what}; log: {self.log_path}" + (f"; last lines: {tail}" if tail else "")
        )

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError("server already started")
        binary = self.binary
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        if not binary.is_file() or not os.access(binary, os.X_OK):
            raise self._fail(f"binary {binary} is missing or not executable")
        for what, p in (("model", self._model), ("draft model", self._draft)):
            if p is not None and not p.is_file():
                raise self._fail(f"{what} {p} does not exist")
        if self.port is None:
            self.port = _free_port(self.host)
        elif _port_in_use(self.host, self.port):
            raise self._fail(f"port {self.host}:{self.port} is already in use")
        args, self.dropped = adapt_args(binary, self.args)  # the flags an older llama-server does not know
        cmd = [str(binary), "--host", self.host, "--port", str(self.port), *args]
        env = {**os.environ, **self.env}
        if env.get("LD_PRELOAD"):  # a trace or fault shim: an ASan build's runtime must still come first
            env["LD_PRELOAD"] = sanitizer_first(binary, env["LD_PRELOAD"])
        self._log_fh = self.log_path.open("wb")
        self._log_fh.write(f"$ {' '.join(cmd)}\n".encode())
        if self.dropped:
            self._log_fh.write(f"# harness: dropped {', '.join(self.dropped)} (this llama-server does not know them)\n"
                               .encode())  # fmt: skip
        self._log_fh.flush()
        try:
            with shielded():  # a Ctrl-C now is raised once the server is known (and then stops it)
                try:
                    self.proc = subprocess.Popen(
                        cmd, stdin=subprocess.DEVNULL, stdout=self._log_fh, stderr=subprocess.STDOUT, env=env,
                        start_new_session=True, preexec_fn=self._preexec,
                    )  # fmt: skip
                except (OSError, subprocess.SubprocessError) as e:
                    self._close_log()
                    raise self._fail(f"could not be started: {e}") from None
                track(self.proc.pid)
                with _LIVE_LOCK:
                    _LIVE.add(self)
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _preexec(self) -> None:  # pragma: no cover - runs in the child between fork and exec
        if sys.platform == "linux":
            _die_with_parent()
        if self.preexec is not None:
            self.preexec()

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise self._fail(f"exited during startup with code {rc}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError:
                pass  # 503 while loading the model
            except (urllib.error.URLError, OSError):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise self._fail(f"did not become healthy within {self.startup_timeout:.0f}s")
            time.sleep(0.1)
            check()

    def stop(self) -> int | None:
        """SIGTERM the process group, SIGKILL after ``stop_timeout`` (at once after a Ctrl-C); the exit code."""
        proc = self.proc
        rc: int | None = None
        if proc is not None and self._stopped:
            return proc.returncode
        if proc is not None:
            self._stopped = True
            try:
                if proc.poll() is None and interrupted():  # no grace: the run is ending
                    self._signal(proc, signal.SIGKILL)
                    proc.wait()
                elif proc.poll() is None:
                    self._signal(proc, signal.SIGTERM)
                    try:
                        proc.wait(self.stop_timeout)
                    except subprocess.TimeoutExpired:
                        self._signal(proc, signal.SIGKILL)
                        proc.wait()
                else:
                    self._signal(proc, signal.SIGKILL)  # stray children of an exited leader
            except KeyboardInterrupt:
                self._signal(proc, signal.SIGKILL)
                proc.wait()
                raise
            finally:
                rc = proc.returncode
                self._record_exit(proc.pid, rc)
                untrack(proc.pid)
                with _LIVE_LOCK:
                    _LIVE.discard(self)
                self._close_log()
        return rc

    def _record_exit(self, pid: int, rc: int | None) -> None:
        """A coverage run (:mod:`harness.trees.gcov`) counts the servers that exited without their counters."""
        path = self.env.get(SERVER_EXITS_ENV) or os.environ.get(SERVER_EXITS_ENV)
        if path:
            with contextlib.suppress(OSError), open(path, "a") as f:
                f.write(f"{pid} {rc}\n")

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        try:
            os.killpg(proc.pid, sig)  # start_new_session: the group id is the leader's pid
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                if proc.poll() is None:
                    proc.send_signal(sig)

    def _close_log(self) -> None:
        if self._log_fh is not None:
            with contextlib.suppress(OSError):
                self._log_fh.close()
            self._log_fh = None

    # -- requests ---------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        """A JSON request. Any answer that is not a usable one raises :class:`RequestFailed`: an HTTP
        error (with the server's message), a dropped connection or a timeout (saying whether the server
        is still alive), or a body that is not JSON."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            f"{self.url}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise RequestFailed(method, path, "http", status=e.code, message=_error_message(e.read())) from None
        except (TimeoutError, urllib.error.URLError, http.client.HTTPException, OSError) as e:
            timed_out = isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)
            alive = self._alive_after_failure(0.5 if timed_out else 5.0)
            rc = None if alive or self.proc is None else self.proc.returncode
            ended = "" if alive else self._log_text()
            raise RequestFailed(method, path, "timeout" if timed_out and alive else "dropped", alive=alive,
                                server_exit=rc, log=ended) from None  # fmt: skip
        try:
            return json.loads(raw or b"null")
        except ValueError:
            raise RequestFailed(method, path, "malformed", message=raw[:80].decode(errors="replace")) from None

    def _log_text(self) -> str:
        """The server's log so far; "" when there is none, or when a run that is ending (a Ctrl-C) has already
        removed it while a client thread's request was failing."""
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _alive_after_failure(self, grace: float) -> bool:
        """Is the server still running once a request failed? A dying server closes its connections
        before it exits: give it ``grace`` seconds to finish dying."""
        if self.proc is None:
            return False
        deadline = time.monotonic() + grace
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.proc.poll() is None

    def completion(
        self, prompt: str | Sequence[int], n_predict: int = 8, *, id_slot: int | None = None, **kw: Any
    ) -> Any:
        """``POST /completion`` with temperature 0 and ``cache_prompt`` on; ``kw`` override fields.

        The fields this binary's version needs on every completion (:func:`probe`) are added first."""
        body: dict[str, Any] = {
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "n_predict": n_predict,
            "temperature": 0.0,
            "cache_prompt": True,
            **completion_fields(self.binary),
        }
        if id_slot is not None:
            body["id_slot"] = id_slot
        body.update(kw)
        return self.request("POST", "/completion", body)

    def log_through(self, releases: int, timeout: float = 10.0) -> str:
        """The log once it shows ``releases`` slot releases ("stop processing"), or as it is at ``timeout``.

        llama-server writes its log from a worker thread (``common_log``), so a line about a request
        can land after the HTTP response; everything a request logged precedes its release line."""
        assert self.log_path is not None
        deadline = time.monotonic() + timeout
        while True:
            text = self.log_path.read_text(errors="replace")
            if text.count("stop processing: n_tokens") >= releases or time.monotonic() > deadline:
                return text
            time.sleep(0.02)

    def logged(self, releases: int) -> str:
        """:meth:`log_through` ``releases``, or "" for a server started without a log."""
        return self.log_through(releases) if self.log_path is not None else ""

    def health(self) -> Any:
        return self.request("GET", "/health")

    def fresh_completion(self, tokens: Sequence[int], n_predict: int) -> Any:
        """``tokens`` computed from scratch (``cache_prompt`` off), with the top two log-probabilities of each token
        generated among the tokens it could sample: the reference answer an answer served from a cache is compared
        with. (The server reports the raw distribution; the tokens every completion bans, :func:`withheld_tokens`,
        are asked for besides the two and left out, :func:`sampleable`.)"""
        withheld = withheld_tokens(self.binary)
        answer = self.completion(list(tokens), n_predict, ignore_eos=True, return_tokens=True, cache_prompt=False,
                                 n_probs=2 + len(withheld))  # fmt: skip
        return sampleable(answer, withheld)

    def slot_n_ctx(self) -> int:
        """The slots' ``n_ctx`` as ``GET /slots`` reports it (``server_slot::to_json``); 0 where the server does not
        say (``--no-slots``, another version's fields, a failed request)."""
        try:
            return int(self.request("GET", "/slots")[0]["n_ctx"])
        except (RequestFailed, LookupError, TypeError, ValueError):
            return 0


# --------------------------------------------------------------------------------------------
# command
# --------------------------------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of process ``pid`` in bytes, and its minor page faults so far (``minflt``)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    with open(f"/proc/{pid}/stat") as f:
        out["minflt"] = int(f.read().rsplit(")", 1)[1].split()[7])
    return out


def _error_message(body: bytes) -> str:
    """The message of llama-server's error answer (``{"error": {"message": ...}}``), else the body's start."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace").strip()
    if isinstance(err, dict):
        return str(err.get("message") or err)[:300]
    return str(err)[:300]


_FORMS: dict[Path, dict[str, Any]] = {}


def completion_fields(binary: Path) -> dict[str, Any]:
    """The fields every completion to ``binary`` carries, as :mod:`harness.backends.llama_server.probe` decided
    (nothing, unless a probe found this binary's version needs them)."""
    return dict(_FORMS.get(binary.resolve(), {}))


def set_completion_fields(binary: Path, fields: dict[str, Any]) -> None:
    _FORMS[binary.resolve()] = dict(fields)


def sampleable(answer: Any, withheld: frozenset[int]) -> Any:
    """``answer`` (a completion's JSON) with the ``withheld`` tokens left out of each ``top_logprobs`` list: the
    probabilities the server reports among the tokens it could have sampled."""
    if not withheld:
        return answer
    probs = [{**p, "top_logprobs": [t for t in p.get("top_logprobs") or [] if int(t["id"]) not in withheld]}
             for p in answer.get("completion_probabilities") or []]  # fmt: skip
    return {**answer, "completion_probabilities": probs}


def withheld_tokens(binary: Path) -> frozenset[int]:
    """The tokens every completion to ``binary`` bans (``logit_bias`` false in its fields: the byte tokens
    0x80-0xFF where the version answers HTTP 500 to a generation that is not valid UTF-8): the server never samples
    them, while the probabilities it reports (``n_probs``) are the raw distribution that holds them."""
    bias = completion_fields(binary).get("logit_bias") or ()
    return frozenset(int(t) for t, v in bias if v is False)


def completion_form_known(binary: Path) -> bool:
    """Whether this process registered what ``binary``'s completions carry (a probe, or a form agreed between
    servers); a replay program pasted into a new process has none until it probes."""
    return binary.resolve() in _FORMS


# --------------------------------------------------------------------------------------------
# logs
# --------------------------------------------------------------------------------------------


_LOG_SEQ = itertools.count()


def unique_log(log_dir: str, stem: str) -> str:
    """One log file per server started (a server's log is scanned for sanitizer reports after it exits)."""
    return os.path.join(log_dir, f"{stem}-{next(_LOG_SEQ):05d}.log")


SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:")


def sanitizer_reports(log_dir: str) -> list[str]:
    """The first line of every ASan, LSan or UBSan report in the server logs under ``log_dir``."""
    return [r for name in sorted(os.listdir(log_dir)) for r in log_sanitizer_reports(Path(log_dir, name))]


def log_sanitizer_reports(log: Path) -> list[str]:
    """The first line of every ASan, LSan or UBSan report in one server's ``log`` (none when it is no file)."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    reports = []
    for marker in SANITIZER_MARKERS:
        at = text.find(marker)
        while at >= 0:
            reports.append(f"{log.name}: {text[at:].splitlines()[0]}")
            at = text.find(marker, at + 1)
    return reports
