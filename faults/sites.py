"""Where a native fault struck, observed: the shim's stacks parsed, symbolized and reduced to one site.

The native shim (``shim.c``) writes two kinds of stack into the stacks file (``FAULTS_STACKS``): the call
stack of every allocation it fails, at the moment it fails it (``faultshim: failed allocation #N (SIZE B,
malloc), stack:``, before it returns NULL and ``operator new`` throws), and the stack of a fatal signal
(``native stack (faultshim, signal SIGABRT):``). What this module promises:

* :func:`parse_stacks` reads them back as :class:`Stack` rows (frames as written: module, dladdr's symbol,
  the address relative to the module's load base).
* :class:`Symbolizer` names each frame: ``addr2line -f -C`` on the module at that address (the symbol
  table, which also holds static functions; a file only when the module says one: DWARF, or the
  ``STT_FILE`` symbol in front of a local function, so never a guessed one), else dladdr's exported symbol
  demangled (``c++filt``, else :func:`demangle`, a small demangler of nested names).
* :func:`site_of` is the *observed site* of a stack: its first frame in llama.cpp code (``libllama*``,
  ``libggml*``, ``libmtmd*``, ``llama-*`` executables such as ``llama-server``) that is not an allocator
  or STL frame, as a :class:`Site`: ``file:function`` when the module gave a file, else
  ``library:function`` (the builds have no ``-g``: mostly the latter).
* :func:`observe` is what one fault trial saw: the first failed allocation (its site, number, size) and,
  when the process died of a signal, that signal and its own first llama.cpp frame.
* :func:`site_agrees`: whether an observed site is the model's predicted one, through the table of
  :mod:`harness.model.sites`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from harness.model.sites import upstream

__all__ = [
    "Frame",
    "Observation",
    "Site",
    "Stack",
    "Symbolizer",
    "allocation_text",
    "demangle",
    "modules_beside",
    "observe",
    "parse_stacks",
    "site_agrees",
    "site_of",
]

_ALLOC_HEAD = re.compile(r"^faultshim: failed allocation #(\d+) \((\d+) B, (\w+)\), stack:$")
_SIGNAL_HEAD = re.compile(r"^native stack \(faultshim, signal (\w+)\):$")
# backtrace_symbols_fd's "MODULE(SYMBOL+0xOFF)[0xADDR]", the shim's " @0xREL" after it
_FRAME = re.compile(
    r"^(?P<module>[^()\[\]]*)(?:\((?P<sym>[^()+]*)\+0x(?P<off>[0-9a-f]+)\))?\[0x(?P<addr>[0-9a-f]+)\]"
    r"(?: @0x(?P<rel>[0-9a-f]+))?$"
)


@dataclass(frozen=True)
class Frame:
    module: str  # the path dladdr gave ("" or "??": unknown)
    symbol: str  # dladdr's (mangled) symbol: exported ones only; "" when none
    rel: int | None  # the return address relative to the module's load base
    raw: str


@dataclass(frozen=True)
class Stack:
    kind: str  # "allocation" (the shim failed it) or "signal" (the process received it)
    frames: tuple[Frame, ...]
    nth: int | None = None  # allocation: its number since arming
    size: int | None = None  # allocation: bytes asked for
    allocator: str | None = None  # allocation: malloc, calloc, realloc, posix_memalign, ...
    signal: str | None = None  # signal: SIGABRT, SIGSEGV, ...


def allocation_text(text: str) -> str:
    """Only the failed allocations' sections of a stacks file's ``text`` (their header and frames), as written."""
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        stripped = line.strip()
        if _ALLOC_HEAD.match(stripped):
            inside = True
        elif not (inside and _FRAME.match(stripped)):
            inside = False
        if inside:
            out.append(stripped)
    return "\n".join(out)


def parse_stacks(text: str) -> list[Stack]:
    """Every stack the shim wrote in ``text``, in order (other lines, e.g. faulthandler's, are skipped)."""
    out: list[Stack] = []
    head: Stack | None = None  # the stack being read, its frames in ``frames``
    frames: list[Frame] = []

    def close() -> None:
        if head is not None:
            out.append(replace(head, frames=tuple(frames)))

    for line in text.splitlines():
        line = line.strip()
        a, s = _ALLOC_HEAD.match(line), _SIGNAL_HEAD.match(line)
        if a or s:
            close()
            frames = []
            if a:
                head = Stack("allocation", (), nth=int(a[1]), size=int(a[2]), allocator=a[3])
            else:
                assert s is not None
                head = Stack("signal", (), signal=s[1])
            continue
        m = _FRAME.match(line) if head is not None else None
        if m is None:
            close()
            head = None
            continue
        rel = m["rel"] or (m["off"] if not m["sym"] else None)  # glibc's own "(+0xOFF)" is base-relative
        frames.append(Frame(m["module"] or "", m["sym"] or "", None if rel is None else int(rel, 16), line))
    close()
    return out


@dataclass(frozen=True)
class Site:
    """One frame, named: ``library`` is the module's file name, ``function`` qualified without parameters."""

    library: str
    function: str
    file: str | None = None
    line: int | None = None
    full: str = ""  # the demangled name as the symbolizer gave it (parameters, clones)

    def __str__(self) -> str:
        where = self.file if self.file else self.library
        return f"{where}:{self.function}"


_LLAMA_MODULES = re.compile(r"^(libllama|libggml|libmtmd|llama-)")
# frames of the allocation or the abort itself, never the site: the STL, operator new, ggml's allocator
# wrappers, ggml's abort (GGML_ASSERT/GGML_ABORT: the site is its caller)
_ALLOCATOR = re.compile(
    r"^(std::|__gnu_cxx::|__cxxabiv1::|__cxa_|operator new|operator delete|ggml_aligned_malloc$|ggml_malloc$|"
    r"ggml_calloc$|malloc$|calloc$|realloc$|ggml_abort$|ggml_print_backtrace)"
)


def is_llama_module(module: str) -> bool:
    return bool(_LLAMA_MODULES.match(os.path.basename(module)))


def qualified(name: str) -> str:
    """A demangled name without its return type, parameters and clone suffix: ``void std::vector<T>::
    _M_default_append(unsigned long) [clone .isra.0]`` is ``std::vector<T>::_M_default_append``."""
    name = re.sub(r"\s*\[clone [^\]]*\]", "", name).strip()
    name = re.sub(r"\s+(const|volatile|&&|&)$", "", name)
    if name.endswith(")"):  # drop the parameter list: the outermost (...) at the end
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    # a template's return type comes first: keep the last name at nesting depth 0, with "operator X" whole
    depth, tokens, cur = 0, [], ""
    for ch in name:
        depth += {"<": 1, ">": -1, "(": 1, ")": -1}.get(ch, 0)
        if ch == " " and depth == 0:
            tokens.append(cur)
            cur = ""
        else:
            cur += ch
    tokens.append(cur)
    tokens = [t for t in tokens if t]
    for i, t in enumerate(tokens):
        if t == "operator" or t.endswith("::operator"):
            return " ".join(tokens[i:])
    return tokens[-1] if tokens else name


class Symbolizer:
    """Names frames, one ``addr2line`` run per module for all its addresses (cached).

    ``modules`` maps a module's file name to its path, for a frame whose path dladdr left empty or
    relative (the main program started by a relative name).
    """

    def __init__(self, modules: Mapping[str, str] | None = None) -> None:
        self.modules = dict(modules or {})
        self._cache: dict[tuple[str, int], tuple[str | None, str | None, int | None]] = {}
        self._addr2line = shutil.which("addr2line")

    def _path(self, module: str) -> str | None:
        if module and os.path.isabs(module) and os.path.exists(module):
            return module
        return self.modules.get(os.path.basename(module)) if module else None

    def _resolve(self, path: str, rels: Iterable[int]) -> None:
        todo = sorted({r for r in rels if (path, r) not in self._cache})
        if not todo:
            return
        got: list[tuple[str | None, str | None, int | None]] = [(None, None, None)] * len(todo)
        if self._addr2line is not None:
            # a return address points after the call: one byte back is inside the calling instruction
            argv = [self._addr2line, "-f", "-C", "-e", path, *(hex(max(r - 1, 0)) for r in todo)]
            try:
                lines = subprocess.run(
                    argv, capture_output=True, text=True, timeout=60, check=False, env=_clean_env()
                ).stdout
            except (OSError, subprocess.TimeoutExpired):
                lines = ""
            pairs = lines.splitlines()
            if len(pairs) == 2 * len(todo):
                got = [_addr2line_row(pairs[2 * i], pairs[2 * i + 1]) for i in range(len(todo))]
        for r, row in zip(todo, got, strict=True):
            self._cache[(path, r)] = row

    def name(self, frames: Iterable[Frame]) -> list[Site]:
        """Every frame named (``?`` for a function nothing could name)."""
        frames = list(frames)
        by_path: dict[str, list[int]] = {}
        for f in frames:
            path = self._path(f.module)
            if path is not None and f.rel is not None:
                by_path.setdefault(path, []).append(f.rel)
        for path, rels in by_path.items():
            self._resolve(path, rels)
        fallback = demangle_all([f.symbol for f in frames if f.symbol])
        out = []
        for f in frames:
            path = self._path(f.module)
            fn, file, line = (None, None, None)
            if path is not None and f.rel is not None:
                fn, file, line = self._cache.get((path, f.rel), (None, None, None))
            if fn is None and f.symbol:
                fn = fallback.get(f.symbol, f.symbol)
            full = fn or "?"
            out.append(Site(os.path.basename(f.module) or "??", qualified(full), file, line, full))
        return out


def modules_beside(binary: str | os.PathLike[str]) -> dict[str, str]:
    """A program and the shared libraries in its directory, by file name (a :class:`Symbolizer`'s ``modules``)."""
    path = os.fspath(binary)
    found = {os.path.basename(path): path}
    folder = os.path.dirname(path) or "."
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith("lib") and ".so" in name:
            found.setdefault(name, os.path.join(folder, name))
    return found


def _clean_env() -> dict[str, str]:
    """This process's environment without the shim: a tool run from a child under it is not faulted."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith(("FAULTSHIM_", "FAULTS_"))}


def _addr2line_row(fn: str, where: str) -> tuple[str | None, str | None, int | None]:
    fn = fn.strip()
    file, _, line = where.strip().rpartition(":")
    line = line.split(" ", 1)[0]  # "123 (discriminator 2)"
    return (
        None if fn in ("", "??") else fn,
        None if file in ("", "??") else os.path.basename(file),
        int(line) if line.isdigit() and line != "0" else None,
    )


def demangle_all(symbols: Iterable[str]) -> dict[str, str]:
    """Itanium C++ names demangled: ``c++filt`` if installed, else :func:`demangle` (plain C names as they are)."""
    names = sorted({s for s in symbols if s})
    mangled = [s for s in names if s.startswith("_Z")]
    out = {s: s for s in names}
    tool = shutil.which("c++filt")
    if mangled and tool is not None:
        try:
            res = subprocess.run(
                [tool], input="\n".join(mangled), capture_output=True, text=True, timeout=30, env=_clean_env()
            )
            lines = res.stdout.splitlines()
            if len(lines) == len(mangled):
                out.update(zip(mangled, lines, strict=True))
                return out
        except (OSError, subprocess.TimeoutExpired):
            pass
    out.update({s: demangle(s) for s in mangled})
    return out


_CTOR_DTOR = {"C1": "ctor", "C2": "ctor", "C3": "ctor", "D0": "dtor", "D1": "dtor", "D2": "dtor"}
_STD_ABBREV = {"St": "std", "Sa": "std::allocator", "Sb": "std::basic_string", "Ss": "std::string"}


def demangle(sym: str) -> str:
    """The qualified name of an Itanium-mangled function, without its parameters; ``sym`` itself when it
    is not one this small demangler reads (templates, substitutions other than ``std``)::

        >>> demangle("_ZN24common_prompt_checkpoint10update_tgtEP13llama_contextij")
        'common_prompt_checkpoint::update_tgt'
    """
    if not sym.startswith("_Z"):
        return sym
    s, i = sym, 2
    if s.startswith("L", i):
        i += 1
    parts: list[str] = []

    def source_name(j: int) -> tuple[str, int] | None:
        m = re.match(r"\d+", s[j:])
        if not m:
            return None
        n, j = int(m.group()), j + len(m.group())
        return (s[j : j + n], j + n) if j + n <= len(s) else None

    if s.startswith("N", i):
        i += 1
        while i < len(s) and s[i] in "rVKRO":
            i += 1
        while i < len(s) and s[i] != "E":
            if s[i : i + 2] in _STD_ABBREV:
                parts.append(_STD_ABBREV[s[i : i + 2]])
                i += 2
            elif s[i : i + 2] in _CTOR_DTOR:
                cls = parts[-1].rsplit("::", 1)[-1] if parts else "?"
                parts.append(cls if _CTOR_DTOR[s[i : i + 2]] == "ctor" else "~" + cls)
                i += 2
            else:
                got = source_name(i)
                if got is None:
                    return sym  # a template, a substitution, an operator: beyond this demangler
                parts.append(got[0])
                i = got[1]
        return "::".join(parts) if parts else sym
    got = source_name(i)
    return got[0] if got is not None else sym


def site_of(stack: Stack, symbolizer: Symbolizer) -> Site | None:
    """The first frame of ``stack`` in llama.cpp code that is not an allocator or STL frame (None: no such frame)."""
    for frame, site in zip(stack.frames, symbolizer.name(stack.frames), strict=True):
        if not is_llama_module(frame.module) or site.function == "?":
            continue
        if _ALLOCATOR.match(site.function):
            continue
        return site
    return None


@dataclass(frozen=True)
class Observation:
    """What one fault trial saw: the first allocation the shim failed, and a fatal signal if the process died."""

    site: Site | None = None  # where the first failed allocation was made (None: none failed, or no frame)
    nth: int | None = None
    size: int | None = None
    failed: int = 0  # allocations the shim failed (and wrote a stack of)
    signal: str | None = None  # the fatal signal the shim saw, if any
    died_at: Site | None = None  # that signal's own first llama.cpp frame (an abort: where it was raised)
    frames: list[str] = field(default_factory=list)  # the failed allocation's named frames, for people

    def agrees_with(self, predicted: str) -> bool:
        """Whether the model's ``predicted`` site (``-``: no allocation fails) is what this trial saw."""
        if predicted == "-":
            return self.failed == 0
        return self.site is not None and site_agrees(predicted, self.site)

    def fault(self) -> str:
        """``common.cpp:common_prompt_checkpoint::update_tgt`` (or ``-``: no allocation failed)."""
        if self.failed == 0:
            return "-"
        return str(self.site) if self.site is not None else "? (no llama.cpp frame in the allocation's stack)"

    def describe(self) -> str:
        """The allocation that failed, in words: ``allocation #2 of 1048576 B failed; SIGABRT at ...``."""
        parts = []
        if self.failed:
            parts.append(f"allocation #{self.nth} of {self.size} B failed")
        if self.signal is not None:
            parts.append(f"{self.signal}" + (f" in {self.died_at}" if self.died_at is not None else ""))
        return "; ".join(parts) or "no allocation failed"


def observe(stacks: str, modules: Mapping[str, str] | None = None, symbolizer: Symbolizer | None = None) -> Observation:
    """The :class:`Observation` of one trial's stacks file text (``modules``: see :class:`Symbolizer`; a
    ``symbolizer`` shared between trials names each address once)."""
    sym = symbolizer or Symbolizer(modules)
    rows = parse_stacks(stacks)
    allocs = [r for r in rows if r.kind == "allocation"]
    signals = [r for r in rows if r.kind == "signal"]
    first = allocs[0] if allocs else None
    named = sym.name(first.frames) if first is not None else []
    shown = [
        f"{s.library}: {s.full}" + (f" ({s.file}{':' + str(s.line) if s.line else ''})" if s.file else "")
        for f, s in zip(first.frames if first else (), named, strict=True)
        if "shim-" not in os.path.basename(f.module)
    ]
    return Observation(
        site=site_of(first, sym) if first is not None else None,
        nth=first.nth if first is not None else None,
        size=first.size if first is not None else None,
        failed=len(allocs),
        signal=signals[0].signal if signals else None,
        died_at=site_of(signals[0], sym) if signals else None,
        frames=shown,
    )


def site_agrees(predicted: str, observed: Site) -> bool:
    """Whether ``observed`` (a stack's first llama.cpp frame) is the model's ``predicted`` site, by the table of
    :mod:`harness.model.sites` (a site the table does not know never agrees)."""
    up = upstream(predicted)
    return up is not None and up.shows(observed.function)
