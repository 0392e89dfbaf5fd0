"""What several commands share: the one spelling of the master/PR axis, of the fixture models, and the one way
to choose a ``llama-server`` (:func:`add_server_options` declares the flags, :func:`resolve_server` turns them into
a :class:`~harness.trees.build.ServerBuild`, :func:`resolve_servers` into a server per semantics for a command
that runs several at once), as memray's commands share one base for their common options."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from harness.errors import UsageError
from harness.trees.build import ServerBuild, server_build
from harness.trees.choose import ServerChoice
from harness.trees.semantics import infer_semantics
from harness.trees.tree import check_tree

__all__ = [
    "SEMANTICS",
    "Several",
    "add_archs",
    "add_semantics",
    "add_server_options",
    "archs_of",
    "resolve_server",
    "resolve_servers",
    "semantics_of",
]

SEMANTICS = ("shared", "master")

Several = Literal["replace", "add"]
"""How a command that runs a server per semantics at once reads the flags (:func:`resolve_servers`)."""


def add_semantics(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--semantics shared|master`` (``shared`` is PR #27451), and the deprecated ``--variant``."""
    parser.add_argument("--semantics", choices=SEMANTICS, help="shared (PR #27451) or master (default shared)")
    parser.add_argument("--variant", choices=SEMANTICS, help=argparse.SUPPRESS)


def semantics_of(args: argparse.Namespace) -> str:
    """The semantics asked for; ``--variant`` still works, with a one-line note on stderr."""
    if getattr(args, "variant", None) is not None:
        print(f"note: --variant is deprecated; use --semantics {args.variant}", file=sys.stderr)
        if args.semantics is not None and args.semantics != args.variant:
            raise UsageError(f"--variant {args.variant} contradicts --semantics {args.semantics}; use --semantics")
        return str(args.variant)
    return str(args.semantics or "shared")


def add_server_options(
    parser: argparse.ArgumentParser, *, source: bool = True, asan: bool = True, several: Several | None = None
) -> None:
    """The flags that choose a ``llama-server``, in one group of ``--help``: ``--semantics`` (the pinned tree's
    build: shared, the default, or master), ``--asan`` (its AddressSanitizer build), ``--source DIR`` (a tree,
    built and cached) and ``--server-bin PATH`` (a binary as it is). A command that cannot build a tree or an
    instrumented server leaves those out. A command that runs a server per semantics at once says how it reads
    them with ``several`` (:func:`resolve_servers`; ``source`` and ``asan`` are then not read)."""
    group = parser.add_argument_group("which llama-server")
    if several is not None:
        _add_several(group, several)
        return
    add_semantics(group)
    if asan:
        group.add_argument("--asan", action="store_true", help="the AddressSanitizer build of the shared semantics")
    if source:
        group.add_argument("--source", metavar="DIR", type=Path, help="build llama-server from this llama.cpp tree")
    group.add_argument("--server-bin", metavar="PATH", type=Path,
                       help="run this binary (e.g. the coverage build) instead of building one")  # fmt: skip


def _add_several(group: argparse._ArgumentGroup, several: Several) -> None:
    """The group's flags for a command that runs a server per semantics: ``--semantics`` means what ``several``
    says (:func:`resolve_servers`), so its help does too."""
    if several == "add":
        group.add_argument("--semantics", choices=SEMANTICS, action="append",
                           help="a pinned build to run (repeatable; default both: shared, the PR; master)")  # fmt: skip
        group.add_argument("--source", metavar="DIR", type=Path, help="also run llama-server built from this tree")
        return
    # an empty value is no value, as these flags have always been read
    group.add_argument("--source", metavar="DIR", type=_path_or_none,
                       help="your llama.cpp tree: built and measured for its semantics")  # fmt: skip
    group.add_argument("--server-bin", metavar="PATH", type=_path_or_none,
                       help="a llama-server binary (with --semantics)")  # fmt: skip
    group.add_argument("--semantics", choices=SEMANTICS, help="the semantics of --source/--server-bin")


def _path_or_none(value: str) -> Path | None:
    return Path(value) if value else None


def resolve_server(args: argparse.Namespace, log: Callable[[str], None] | None = None) -> ServerBuild:
    """The ``llama-server`` the flags of :func:`add_server_options` name: built or reused, with what is known of
    it. A contradiction (``--server-bin`` with a build's flags, ``--source`` with ``--semantics``, ``--asan`` with
    ``--semantics master``) is one line and exit 2."""
    say = log or (lambda m: print("  build: " + m, file=sys.stderr))
    semantics = semantics_of(args) if (args.semantics or getattr(args, "variant", None)) else None
    source: Path | None = getattr(args, "source", None)
    asan: bool = getattr(args, "asan", False)
    if args.server_bin is not None:
        if source is not None or semantics is not None or asan:
            raise UsageError("--server-bin runs the binary as it is: drop --source, --semantics and --asan")
        return server_build(binary=args.server_bin, log=say)
    if source is not None:
        if semantics is not None:
            raise UsageError("--semantics picks the pinned tree's build; with --source the tree is what it is")
        return server_build(source=source, asan=asan, log=say)
    if asan and semantics == "master":
        raise UsageError("--asan builds the PR semantics only; drop --semantics master or --asan")
    return server_build(semantics=semantics or "shared", asan=asan, log=say)


def resolve_servers(
    args: argparse.Namespace, several: Several, semantics: Sequence[str] = SEMANTICS
) -> list[ServerChoice]:
    """The ``llama-server`` of each semantics that the flags of ``add_server_options(parser, several=...)`` name,
    checked but not built (a command builds each when it runs it: :meth:`ServerChoice.build`). A contradiction or
    a tree whose semantics cannot be read is one line and exit 2.

    The rules differ by what ``--semantics`` means to the command, which ``several`` says:

    - ``"replace"`` (``report``: both sides measured against each other): one server for each of ``semantics``,
      in that order, the pinned build unless ``--source`` or ``--server-bin`` (not both) stands for it. A tree
      stands for the semantics read from it unless ``--semantics`` is given; a binary for ``--semantics``, which
      it needs; ``--semantics`` alone says nothing.
    - ``"add"`` (``oom``: each build judged on its own): the pinned build of each ``--semantics`` given
      (repeatable; all of ``semantics`` by default), then ``--source``'s tree under the semantics read from it,
      which ``--semantics`` cannot change (it names pinned builds here).
    """
    if several == "add":
        chosen = [ServerChoice(s) for s in args.semantics or semantics]
        if args.source is not None:
            inferred = infer_semantics(check_tree(args.source))
            if inferred.semantics is None:
                raise UsageError(f"--source {args.source}: cannot tell its semantics ({inferred.why})")
            chosen.append(ServerChoice(inferred.semantics, source=args.source))
        return chosen
    side = _side(args.source, args.server_bin, args.semantics)
    return [ServerChoice(s, args.source, args.server_bin) if s == side else ServerChoice(s) for s in semantics]


def _side(source: Path | None, binary: Path | None, semantics: str | None) -> str | None:
    """``resolve_servers(several="replace")``: the semantics ``--source`` or ``--server-bin`` stands for (None
    when neither is given), after its checks."""
    if semantics is not None and source is None and binary is None:
        raise UsageError("--semantics says which side --source or --server-bin stands for; give one of them")
    if source is not None and binary is not None:
        raise UsageError("--source and --server-bin are alternatives: give one")
    if source is not None and semantics is None:
        if not source.is_dir():
            raise UsageError(f"--source {source}: not a directory")
        inferred = infer_semantics(source)
        if inferred.semantics is None:
            raise UsageError(f"--source {source}: {inferred.why}; say --semantics shared|master")
        return inferred.semantics
    if binary is not None:
        if semantics is None:
            raise UsageError("--server-bin needs --semantics shared|master (which side the binary stands for)")
        if not binary.is_file():
            raise UsageError(f"--server-bin {binary}: no such file")
    return semantics


def add_archs(parser: argparse.ArgumentParser, known: Sequence[str], what: str) -> None:
    """``--arch NAME [NAME ...]``: which of the generated fixture models (``known``) to run, all by default; the
    old ``--models A,B`` is still read, with a note."""
    parser.add_argument("--arch", nargs="+", metavar="NAME", help=f"{what} ({', '.join(known)}; default all)")
    parser.add_argument("--models", metavar="A,B", help=argparse.SUPPRESS)  # the old spelling of --arch


def archs_of(args: argparse.Namespace, known: Sequence[str]) -> tuple[str, ...]:
    """The fixture models :func:`add_archs`'s flags name, each one of ``known`` (else one line, exit 2)."""
    if args.models is not None:
        if args.arch:
            raise UsageError("--models is the old spelling of --arch; use --arch only")
        print(f"note: --models is deprecated; use --arch {' '.join(a for a in args.models.split(',') if a)}",
              file=sys.stderr)  # fmt: skip
        names = [a for a in args.models.split(",") if a]
    else:
        names = list(args.arch or known)
    bad = [a for a in names if a not in known]
    if bad or not names:
        raise UsageError(f"unknown --arch {' '.join(bad) or '(none)'}; choose from {', '.join(known)}")
    return tuple(dict.fromkeys(names))
