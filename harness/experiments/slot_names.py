"""Hostile ``filename`` values for ``POST /slots/{id}?action=save|restore``: an explicit list and a Hypothesis tail.

Every name has a class, decided here from what the name *is* on a POSIX file system, never from what
upstream's validator (``fs_validate_filename``, common/common.cpp:796-876 at 0c1e570) happens to accept:

``refuse``
    not one safe path component anywhere: empty, ``.``, ``..``, a ``/`` or ``\\`` (a separator on POSIX or
    Windows), NUL or another C0/C1 control character or DEL, over 255 UTF-8 bytes (NAME_MAX), not Unicode
    (a lone surrogate, bytes that are not UTF-8: overlong forms of ``/`` and ``.``), or a body that names no
    string. Each must get an HTTP 4xx on save and on restore.
``literal``
    one component POSIX takes literally, harmless inside the save directory (percent forms, Windows
    reserved names and characters, trailing dots and spaces, Unicode look-alikes of ``/`` and ``.``,
    bidi overrides, exactly 255 bytes): a 4xx, or a 2xx whose file is ``save/<name>`` and nothing else.
``symlink``
    the name of a symlink the sandbox planted in the save directory: any status, nothing outside touched.
``benign``
    the control: save and restore answer 200 and the file is ``save/<name>``.

A :class:`Name` carries the exact request body, so names JSON cannot spell (raw bytes) are sent as bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from harness.experiments.slot_sandbox import SYMLINKS

__all__ = ["CLASSES", "PIECES", "Name", "classify", "explicit_names", "generated_names", "text_name"]

CLASSES = ("refuse", "literal", "symlink", "benign")


@dataclass(frozen=True)
class Name:
    """One ``filename`` to try: ``label`` is what the table shows (repr of the text, or of the raw bytes)."""

    label: str
    body: bytes  # the whole JSON request body
    cls: str
    text: str | None = None  # the name as text, when it is one (None: raw bytes or no string)
    source: str = "explicit"  # "explicit" | "generated"


def _unsafe_char(c: str) -> bool:
    o = ord(c)
    return c in "/\\" or o <= 0x1F or o == 0x7F or 0x80 <= o <= 0x9F or 0xD800 <= o <= 0xDFFF


def classify(text: str) -> str:
    """The class of a text name (see the module's docstring); the symlink names first."""
    if text in SYMLINKS:
        return "symlink"
    if text in ("", ".", "..") or any(_unsafe_char(c) for c in text):
        return "refuse"
    if len(text.encode("utf-8")) > 255:
        return "refuse"
    return "literal"


def text_name(text: str, cls: str | None = None, source: str = "explicit") -> Name:
    """The name sent as a JSON string (``ensure_ascii``: a surrogate is sent as ``\\udXXX``), classed as the
    server reads it: JSON joins an escaped high and low surrogate into one code point, a lone one stays."""
    body = json.dumps({"filename": text}).encode()
    seen: str = json.loads(body)["filename"]
    return Name(repr(seen), body, cls or classify(seen), seen, source)


def _raw(raw: bytes) -> Name:
    """A name spliced into the JSON as raw bytes (not UTF-8, or a raw control byte): JSON cannot carry it."""
    return Name(f"raw {raw!r}", b'{"filename": "' + raw + b'"}', "refuse")


def _body(label: str, body: bytes) -> Name:
    return Name(label, body, "refuse")


BENIGN = ("slot0.bin", "a", "state-1.bin", "x" * 64, "ünïcødé.bin", "名前.bin", "-evil.bin", ".hidden.bin")


def explicit_names(sandbox_base: Path) -> list[Name]:
    """The list tried on every run, in order: the absolute paths point into the sandbox (``sandbox_base``)."""
    out = [text_name(s, "benign") for s in BENIGN]
    outside = sandbox_base / "root" / "outside"
    texts = [
        # traversal and separators
        "..", ".", "", "../x.bin", "../../x.bin", "../../etc/passwd", "../../../../../../etc/passwd",
        "../outside/secret.bin", "../save-evil/x.bin", "..\\x.bin", "a/b", "a\\b", "./x.bin", "x.bin/",
        "/x.bin", "/tmp/x", str(outside / "secret.bin"), str(outside / "abs.bin"),
        str(sandbox_base / "elsewhere" / "abs.bin"), "//x.bin", "dirlink/x.bin", "dirlink/../x.bin",
        # NUL, controls
        "a\x00b", "x.bin\x00.txt", "\x00", "a\nb", "a\rb", "a\tb", "\x1b[31mred", "a\x7fb", "a\x85b", "a\x9fb",
        # length
        "a" * 255, "a" * 256, "a" * 4096, "a" * 10000, "é" * 127 + "a", "é" * 128,
        # percent forms (sent literally: nothing decodes a JSON body's string)
        "%2e%2e", "%2e%2e%2fx.bin", "..%2fx.bin", "%2fetc%2fpasswd", "%00", "%252e%252e%252f",
        # unicode look-alikes, bidi, surrogates
        "\u2215x.bin", "a\u2215b", "a\uff0fb", "\uff0e\uff0e", "\uff0e\uff0e\uff0fx.bin", "\u2024\u2024",
        "\u2024\u2024\u2215x.bin", "a\u2216b", "a\uff3cb", "\u202enib.exe", "x\u202e", "a\u200bb", "\ufeffx.bin",
        "\ufffd", "\ud800", "a\udc00b", "\ud83d", "\U0001f600.bin", "\ud83d\ude00", "\udfff\ud800",
        # trailing dots and spaces, Windows reserved names and characters
        "x.bin.", "x.bin ", " x.bin", "x.bin...", "...", "CON", "con.bin", "NUL", "AUX.txt", "COM1", "LPT9.bin",
        "a:b", "a*b", "a?b", 'a"b', "a<b", "a>b", "a|b", "x.bin::$DATA",
        # the planted symlinks
        *SYMLINKS, "link.bin/", "new.bin/.",
    ]  # fmt: skip
    out += [text_name(s) for s in texts]
    out += [
        _raw(b"\xc0\xaf"), _raw(b"a\xc0\xafb"), _raw(b"\xc0\xae\xc0\xae\xc0\xafx.bin"), _raw(b"\xe0\x80\xaf"),
        _raw(b"\xf0\x80\x80\xaf"), _raw(b"\xed\xa0\x80"), _raw(b"\xff\xfe"), _raw(b"a\x00b"), _raw(b"a\nb"),
        _body("no filename", b"{}"), _body("filename: null", b'{"filename": null}'),
        _body("filename: 5", b'{"filename": 5}'), _body('filename: ["x.bin"]', b'{"filename": ["x.bin"]}'),
        _body("not JSON", b"filename=x.bin"),
    ]  # fmt: skip
    return out


#: what the generated tail is built from: separators, dots, look-alikes, controls, the symlinks' names
PIECES = (
    "..", ".", "/", "\\", "\x00", "\x01", "\x1f", "\x7f", "\x85", " ", "%2e", "%2f", "%00", "\u2215", "\u2216",
    "\uff0f", "\uff0e", "\u2024", "\u202e", "\u200b", "\ufeff", "\ud800", "\udfff", ":", "*", "?", "|", "~",
    "CON", "x", "x.bin", "etc", "passwd", "secret.bin", "outside", "save-evil", "link.bin", "new.bin", "dirlink",
    "é", "名",
)  # fmt: skip


def generated_names() -> st.SearchStrategy[Name]:
    """Text built from :data:`PIECES` (and a few runs of ``a`` around NAME_MAX), classified by :func:`classify`."""
    long = st.integers(250, 260).map(lambda n: "a" * n)
    piece = st.sampled_from((*PIECES, "")).flatmap(lambda p: st.just(p) if p else long)  # "" stands for a long run
    text = st.lists(piece, min_size=1, max_size=6).map("".join)
    return text.map(lambda t: text_name(t, source="generated"))
