"""Which ``llama-server`` the server gate runs, from its flags as plain values: one function, :func:`choose_builds`,
whose answer (:class:`ChosenServers`) also says the semantics the model runs in, why, and which upstream
switches (:mod:`harness.trees.switches`) it follows there, so the gate reads its tree once.

The server backend's flags name the server one of three ways: ``--server-bin PATH`` (a binary as it is),
``--source TREE`` with an optional ``--base TREE|REV`` (a tree, and the tree its change starts from, both built
and cached) or neither (the pinned tree's build of ``--semantics``, ``--asan`` its sanitizer build). A
contradiction is a :class:`~harness.errors.UsageError` (exit 2) before anything is built; a tree whose semantics
cannot be read is refused before a build of many minutes unless ``--semantics`` was given; a failed build is one
:class:`~harness.errors.BuildError` (exit 4).

A command that runs a server per semantics at once (``report``, ``oom``) holds each as a :class:`ServerChoice`
(the flags checked, nothing built yet: ``harness.commands.common.resolve_servers``) and builds it when it runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.errors import BuildError, UsageError
from harness.trees.build import ServerBuild, server_build
from harness.trees.flags import OPTIONAL, adapt_args
from harness.trees.semantics import infer_semantics
from harness.trees.switches import Switches, switches_of_binary
from harness.trees.tree import check_tree, registry_spec, tree_at_revision

__all__ = ["ChosenServers", "ServerChoice", "choose_builds"]


@dataclass(frozen=True)
class ChosenServers:
    """What the server gate runs: the build under test, the build of the tree its change starts from (``--base``,
    else None), the semantics the model runs in for each and why, and the model's switches read from the tree."""

    build: ServerBuild
    base: ServerBuild | None
    semantics: str
    base_semantics: str
    how: str  # why these semantics
    switches: Switches  # the upstream changes the model follows on ``build``'s tree
    unknown_flags: tuple[str, ...] = ()  # the harness's flags ``build``'s binary does not know (harness.trees.flags)

    @property
    def follows(self) -> str:
        """The switches, one line."""
        return "; ".join(self.switches.lines())


@dataclass(frozen=True)
class ServerChoice:
    """One ``llama-server`` as the flags chose it, not built yet, and the semantics it stands for: the pinned
    tree's build of ``semantics`` (neither ``source`` nor ``binary``), a tree to build (``source``, as given:
    a directory or an upstream build's name) or a binary as it is (``binary``)."""

    semantics: str
    source: Path | None = None
    binary: Path | None = None

    def build(self, log: Callable[[str], None]) -> ServerBuild:
        """The binary, built or reused as :func:`~harness.trees.build.server_build` does (a bad tree or binary is
        a :class:`~harness.errors.UsageError`, a failed build a :class:`~harness.errors.BuildError`)."""
        if self.binary is not None:
            return server_build(binary=self.binary, log=log)
        if self.source is not None:
            return server_build(source=self.source, log=log)
        return server_build(semantics=self.semantics, log=log)


def choose_builds(
    *,
    source: Path | None,
    base: str | None,
    server_bin: Path | None,
    asan: bool,
    semantics: str,
    semantics_given: bool,
    log: Callable[[str], None],
) -> ChosenServers:
    """The build the gate tests and, with ``base``, the build of the tree its change starts from, with the
    semantics the model runs in (``semantics`` if given, else the one the tree shows) and the switches it follows."""
    build, base_build = _builds(source, base, server_bin, asan, semantics, semantics_given, log)
    sem, how = _semantics_for(build, semantics, semantics_given)
    base_sem = sem if base_build is None else (base_build.semantics or sem)
    _, dropped = adapt_args(build.binary, [f for flag, (n, values) in OPTIONAL.items()
                                           for f in (flag, *(values or ("1",))[:n])])  # fmt: skip
    return ChosenServers(build, base_build, sem, base_sem, how, switches_of_binary(build.binary), tuple(dropped))


def _builds(
    source: Path | None,
    base: str | None,
    server_bin: Path | None,
    asan: bool,
    semantics: str,
    semantics_given: bool,
    log: Callable[[str], None],
) -> tuple[ServerBuild, ServerBuild | None]:
    if base is not None and source is None:
        raise UsageError("--base names the tree a change starts from; it needs --source TREE (the changed tree)")
    try:
        if source is not None and server_bin is not None:
            raise UsageError("--source and --server-bin both name the server to test; give one")
        if server_bin is not None:
            if asan:
                raise UsageError("--asan builds llama-server; a --server-bin runs as built (sanitizers detected)")
            return server_build(binary=server_bin, log=log), None
        if source is not None:
            return _from_source(source, base, asan, semantics_given, log)
        if asan and semantics == "master":
            raise UsageError("--asan builds the PR semantics only; drop --semantics master or --asan")
        return server_build(semantics=semantics or "shared", asan=asan, log=log), None
    except BuildError as e:
        raise BuildError(f"llama-server could not be built: {e}") from None


def _semantics_for(build: ServerBuild, semantics: str, semantics_given: bool) -> tuple[str, str]:
    """The semantics the model runs in (``--semantics`` if given, else the one the tree shows) and why."""
    if semantics_given:
        how = "from --semantics"
        if build.semantics is not None and build.semantics != semantics:
            how += (
                f"; note: the tree reads as {build.semantics} ({build.semantics_why}): expect the differential "
                "to diverge"
            )
        return semantics, how
    if build.semantics is None:
        what = "binary" if build.tree is None else "tree"
        why = build.semantics_why or "no build-info.json beside it says"
        raise UsageError(
            f"cannot tell the semantics of the {what} {build.label} ({why}): "
            "pass --semantics shared (PR #27451) or --semantics master"
        )
    if build.by_name:
        return build.semantics, f"the {build.label} build; --semantics overrides"
    where = "inferred from the tree" if build.tree is not None else "from its build-info.json"
    return build.semantics, f"{where}: {build.semantics_why}; --semantics overrides"


def _from_source(
    source: Path, base: str | None, asan: bool, semantics_given: bool, log: Callable[[str], None]
) -> tuple[ServerBuild, ServerBuild | None]:
    """``--source TREE`` (and ``--base``): both trees checked, then built; an upstream build replays by its name."""
    tree = check_tree(source)
    base_tree = _base_tree(base, tree) if base is not None else None
    if not semantics_given:  # before a build of many minutes: can the tree be read?
        _semantics_or_refuse(tree, "tree")
    named = source if registry_spec(str(source)) is not None else tree  # replays by its name
    build = server_build(source=named, asan=asan, log=log)
    if base_tree is None:
        return build, None
    base_named = Path(str(base)) if registry_spec(str(base)) is not None else base_tree
    return build, server_build(source=base_named, asan=asan, log=log, flag="--base")


def _base_tree(base: str, tree: Path) -> Path:
    """``--base``: a directory holding a llama.cpp tree, an upstream build of the package index (``b11434``,
    ``pypi:xllamacpp==2026.10.11549``), or a revision of the git checkout ``tree``."""
    p = Path(base).expanduser()
    if p.is_dir() or registry_spec(base) is not None:
        return check_tree(p, "--base")
    return check_tree(tree_at_revision(tree, base), "--base")


def _semantics_or_refuse(tree: Path, what: str) -> str:
    inferred = infer_semantics(tree)
    if inferred.semantics is None:
        raise UsageError(
            f"cannot tell the semantics of the {what} {tree} ({inferred.why}): "
            "pass --semantics shared (PR #27451) or --semantics master"
        )
    return inferred.semantics
