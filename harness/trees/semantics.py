"""Which semantics a llama.cpp tree has: ``shared`` (PR #27451) or ``master``, read from its headers.

:func:`infer_semantics` reads what the payload members of ``common_prompt_checkpoint`` are. At upstream
0c1e570 (common/common.h:1232) they are ``std::vector<uint8_t> data_tgt, data_dft``: a copy of a checkpoint
deep-copies them (``master``). PR #27451 makes them shared, in either of two spellings this reader follows
through the tree's own headers: a ``shared_ptr`` named directly or through an alias (our patch:
``using data_ptr = std::shared_ptr<const std::vector<uint8_t>>`` inside the struct), or a small class of the
tree's own that holds one (the PR's branch, commit 5c7018ed7: ``common_shared_state_buffer`` with a private
``std::shared_ptr<std::vector<uint8_t>> storage``). Anything else it cannot tell, and says so: the caller
asks for ``--semantics`` rather than guess.

The C++ reading is deliberately small: comments and string literals are blanked, a class body is found
by brace matching, and its top-level statements are split into aliases, data members and the rest
(functions, nested types, access specifiers). It reads declarations as llama.cpp writes them; a type
it cannot follow within :data:`MAX_DEPTH` steps is "cannot tell", never a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CHECKPOINT_STRUCT",
    "MAX_DEPTH",
    "OLDER_CHECKPOINTS",
    "PAYLOAD_MEMBERS",
    "SemanticsInference",
    "blank_comments",
    "infer_semantics",
    "infer_semantics_from_text",
]

CHECKPOINT_STRUCT = "common_prompt_checkpoint"
PAYLOAD_MEMBERS = ("data_tgt", "data_dft")
"""The checkpoint's target and draft state payloads (upstream names): what PR #27451 shares."""
OLDER_CHECKPOINTS: tuple[tuple[str, tuple[str, ...]], ...] = (("server_prompt_checkpoint", ("data",)),)
"""The checkpoint's earlier spellings, read when a tree has no :data:`CHECKPOINT_STRUCT`: upstream's server held
its checkpoints as ``server_prompt_checkpoint`` with one payload ``std::vector<uint8_t> data`` (no draft state;
``tools/server/server-task.h:568`` at b9093) before it became ``common_prompt_checkpoint``."""
MAX_DEPTH = 3
"""Steps through aliases and wrapper classes before a type counts as unknown (alias, class, member)."""

# headers searched for the struct and for the aliases and classes its members name, in this order
_HEADER_DIRS = ("common", "tools/server", "include", "src")


@dataclass(frozen=True)
class SemanticsInference:
    """What :func:`infer_semantics` read: ``semantics`` (None: cannot tell) and why, in one line."""

    semantics: str | None
    why: str


@dataclass(frozen=True)
class _Decl:
    """A class body read into its aliases (name -> type) and data members (name -> type)."""

    aliases: dict[str, str]
    members: dict[str, str]


class _Source:
    """One header: where it came from, its raw text, and (on first use) its text with comments and
    strings blanked."""

    def __init__(self, where: str, raw: str) -> None:
        self.where = where
        self.raw = raw
        self._text: str | None = None

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = blank_comments(self.raw)
        return self._text

    def line_of(self, offset: int) -> int:
        return self.text.count("\n", 0, offset) + 1


def blank_comments(text: str) -> str:
    """``text`` with comments and string/char literals replaced by spaces (newlines kept, so offsets
    and line numbers stay those of the file)."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
        else:
            i += 1
            continue
        for k in range(i, j):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def _matching(text: str, open_at: int, pair: str = "{}") -> int:
    """The offset just past the bracket that closes the one at ``open_at``."""
    depth = 0
    for k in range(open_at, len(text)):
        if text[k] == pair[0]:
            depth += 1
        elif text[k] == pair[1]:
            depth -= 1
            if depth == 0:
                return k + 1
    return len(text)


def _find_class(src: _Source, name: str) -> tuple[str, int] | None:
    """The body of ``struct name {...}`` / ``class name {...}`` (a definition, not a declaration)."""
    pat = re.compile(r"\b(?:struct|class)\s+(?:\w+\s+)*?" + re.escape(name) + r"\b\s*(?:final\b)?\s*(?::[^;{]*)?\{")
    for m in pat.finditer(src.text):
        start = m.end() - 1
        return src.text[start + 1 : _matching(src.text, start) - 1], start
    return None


def _without_templates(s: str) -> str:
    """``s`` with the contents of ``<...>`` removed (so a ``(`` inside a template argument is not a call)."""
    out, depth = [], 0
    for c in s:
        if c == "<":
            depth += 1
        elif c == ">" and depth:
            depth -= 1
        elif depth == 0:
            out.append(c)
    return "".join(out)


def _statements(body: str) -> list[str]:
    """The top-level statements of a class body; a function definition or nested type ends one."""
    out: list[str] = []
    cur: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c == "{":
            end = _matching(body, i)
            head = "".join(cur)
            bare = _without_templates(head)
            if "(" in bare or re.search(r"\b(?:struct|class|union|enum)\b", bare):
                out.append(head)  # a function body or a nested type: the statement ends with it
                cur = []
                i = end
                if i < len(body) and body[i] == ";":
                    i += 1
                continue
            cur.append(body[i:end])  # a brace initializer
            i = end
            continue
        if c == ";":
            out.append("".join(cur))
            cur = []
        elif c == ":" and re.fullmatch(r"\s*(?:public|private|protected)\s*", "".join(cur)):
            cur = []  # an access specifier
        else:
            cur.append(c)
        i += 1
    if "".join(cur).strip():
        out.append("".join(cur))
    return [" ".join(s.split()) for s in out if s.strip()]


def _split_top(s: str, sep: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for c in s:
        if c in "<({[":
            depth += 1
        elif c in ">)}]":
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return parts


def _read_class(body: str) -> _Decl:
    aliases: dict[str, str] = {}
    members: dict[str, str] = {}
    for st in _statements(body):
        st = re.sub(r"^(?:public|private|protected)\s*:\s*", "", st)
        if m := re.fullmatch(r"using\s+(\w+)\s*=\s*(.+)", st):
            aliases[m.group(1)] = m.group(2).strip()
            continue
        if m := re.fullmatch(r"typedef\s+(.+?)\s+(\w+)", st):
            aliases[m.group(2)] = m.group(1).strip()
            continue
        bare = _without_templates(st)
        if "(" in bare.split("=", 1)[0] or re.match(r"(?:static|friend|using|template|enum)\b", st):
            continue  # a function, a static member, a friend, a using-declaration
        decl = re.sub(r"\s*(?:=.*|\{.*\})$", "", st)  # drop the initializer
        first, *more = _split_top(decl, ",")
        m = re.fullmatch(r"(.+?)[\s*&]*\b(\w+)\s*(?:\[[^\]]*\])?", first.strip())
        if m is None:
            continue
        typ = m.group(1).strip()
        members[m.group(2)] = typ
        for extra in more:
            if mm := re.fullmatch(r"\s*(\w+)\s*(?:\[[^\]]*\])?\s*(?:=.*)?", extra):
                members[mm.group(1)] = typ
    return _Decl(aliases, members)


_QUALIFIERS = re.compile(r"\b(?:const|volatile|mutable|typename)\b")
_SHARED = re.compile(r"^(?:::)?(?:std::)?shared_ptr\s*<")
_BYTES = re.compile(r"^(?:::)?std::vector\s*<\s*(?:(?:std::)?u?int8_t|unsigned\s+char|char|std::byte)\s*>$")


def _norm(t: str) -> str:
    return " ".join(_QUALIFIERS.sub(" ", t).split()).replace(" <", "<").replace("< ", "<").replace(" >", ">")


class _Tree:
    """The headers of a tree (or texts given by hand), read lazily and searched by name."""

    def __init__(self, sources: list[_Source]) -> None:
        self.sources = sources

    def find_class(self, name: str) -> tuple[_Source, str, int] | None:
        for s in self.sources:
            if name in s.raw and (found := _find_class(s, name)) is not None:
                return s, found[0], found[1]
        return None

    def find_alias(self, name: str) -> tuple[_Source, str, int] | None:
        pat = re.compile(r"\busing\s+" + re.escape(name) + r"\s*=\s*([^;]+);|\btypedef\s+([^;]+?)\s+" + re.escape(name)
                         + r"\s*;")  # fmt: skip
        for s in self.sources:
            if name in s.raw and (m := pat.search(s.text)) is not None:
                return s, (m.group(1) or m.group(2)).strip(), m.start()
        return None


def _kind(t: str, scope: _Decl, tree: _Tree, depth: int) -> tuple[str | None, str]:
    """``("shared" | "bytes" | None, how)`` for a member type: a shared pointer, a plain byte vector
    (a deep copy), or unknown; ``how`` says what was followed."""
    t = _norm(t)
    if _SHARED.match(t):
        return "shared", t
    if _BYTES.match(t):
        return "bytes", t
    if depth >= MAX_DEPTH:
        return None, f"{t} (not followed past {MAX_DEPTH} steps)"
    name = re.sub(r"^(?:::)?(?:\w+::)*", "", t) if re.fullmatch(r"(?:::)?(?:\w+::)*\w+", t) else None
    if name is None:
        return None, t
    if name in scope.aliases:
        k, how = _kind(scope.aliases[name], scope, tree, depth + 1)
        return k, f"{t} = {how}"
    if (alias := tree.find_alias(name)) is not None:
        src, target, at = alias
        k, how = _kind(target, scope, tree, depth + 1)
        return k, f"{t} ({src.where}:{src.line_of(at)}) = {how}"
    if (cls := tree.find_class(name)) is not None:
        src, body, at = cls
        inner = _read_class(body)
        kinds = {m: _kind(mt, inner, tree, depth + 1) for m, mt in inner.members.items()}
        where = f"{src.where}:{src.line_of(at)}"
        shared = [m for m, (k, _) in kinds.items() if k == "shared"]
        if shared:
            return "shared", f"{t} ({where}), a class holding {kinds[shared[0]][1]} {shared[0]}"
        if kinds and all(k == "bytes" for k, _ in kinds.values()):
            m0 = next(iter(kinds))
            return "bytes", f"{t} ({where}), a class holding {kinds[m0][1]} {m0} by value"
        return None, f"{t} ({where}), a class whose members are " + (
            ", ".join(f"{mt} {m}" for m, mt in inner.members.items()) or "none this reader sees"
        )
    return None, f"{t} (no definition found in the tree's headers)"


def infer_semantics_from_text(headers: dict[str, str]) -> SemanticsInference:
    """:func:`infer_semantics` on header texts given as ``{path: text}`` (searched in that order)."""
    tree = _Tree([_Source(where, text) for where, text in headers.items()])
    spellings = ((CHECKPOINT_STRUCT, PAYLOAD_MEMBERS), *OLDER_CHECKPOINTS)
    hit = next(((s, p, f) for s, p in spellings if (f := tree.find_class(s)) is not None), None)
    if hit is None:
        names = " or ".join(s for s, _ in spellings)
        return SemanticsInference(None, f"no definition of struct {names} in {', '.join(headers)}")
    struct, payloads, (src, body, at) = hit
    decl = _read_class(body)
    where = f"{src.where}:{src.line_of(at)}"
    present = [m for m in payloads if m in decl.members]
    if not present:
        return SemanticsInference(
            None, f"{struct} ({where}) has no {' or '.join(payloads)} member (members: " + ", ".join(decl.members) + ")"
        )
    kinds = {m: _kind(decl.members[m], decl, tree, 0) for m in present}
    by_how: dict[str, list[str]] = {}
    for m, (_, how) in kinds.items():
        by_how.setdefault(how, []).append(m)
    said = "; ".join(
        f"{struct}::{' and ::'.join(ms)} {'is' if len(ms) == 1 else 'are'} {how}"
        for how, ms in by_how.items()
    )
    values = {k for k, _ in kinds.values()}
    if values == {"shared"}:
        return SemanticsInference("shared", f"shared payloads ({where}): {said}")
    if values == {"bytes"}:
        return SemanticsInference("master", f"payloads held by value, deep-copied with a copy ({where}): {said}")
    return SemanticsInference(None, f"cannot tell shared from deep-copied payloads ({where}): {said}")


def _header_texts(src: Path) -> dict[str, str]:
    """The tree's headers in search order: common/common.h first, then the rest of :data:`_HEADER_DIRS`."""
    paths = [src / "common" / "common.h"]
    for d in _HEADER_DIRS:
        base = src / d
        if base.is_dir():
            paths += sorted(p for ext in ("*.h", "*.hpp") for p in base.rglob(ext) if p not in paths)
    out: dict[str, str] = {}
    for p in paths:
        try:
            out[p.relative_to(src).as_posix()] = p.read_text(errors="replace")
        except OSError:
            continue
    return out


def infer_semantics(src: Path) -> SemanticsInference:
    """``shared``/``master`` from the tree's ``common_prompt_checkpoint`` payload members, or None and why."""
    headers = _header_texts(src)
    if not headers:
        return SemanticsInference(None, f"{src} has no readable common/common.h")
    return infer_semantics_from_text(headers)
