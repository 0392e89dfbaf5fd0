"""The one way to choose the llama-servers of a command that runs one per semantics at once (``report``, ``oom``):
``harness.commands.common.resolve_servers`` on each command's own flags, checked before anything is built.

Nothing here builds or runs a server: the trees are three files written here, read for their semantics only.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from types import ModuleType

import pytest

from harness.commands import oom, report
from harness.commands.common import resolve_servers
from harness.errors import UsageError
from harness.report.stages import SEMS
from harness.trees.choose import ServerChoice

MASTER = "struct common_prompt_checkpoint {\n  std::vector<uint8_t> data_tgt;\n  std::vector<uint8_t> data_dft;\n};\n"


def _tree(root: Path, header: str = MASTER) -> Path:
    """Enough of a llama.cpp tree for its checks and its semantics (master's payloads held by value)."""
    (root / "tools" / "server").mkdir(parents=True)
    (root / "common").mkdir()
    (root / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    (root / "common" / "common.h").write_text(header)
    return root


def _args(command: ModuleType, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(argv)


def _report(argv: list[str]) -> list[ServerChoice]:
    return resolve_servers(_args(report, argv), "replace", SEMS)


def test_report_measures_the_pinned_builds_unless_a_tree_or_a_binary_stands_for_a_side(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "tree")
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    assert _report([]) == [ServerChoice("master"), ServerChoice("shared")]
    assert _report(["--source", ""]) == _report([])  # an empty value is no value, as report always read it
    # a tree stands for the semantics read from it, unless --semantics says otherwise
    assert _report(["--source", str(tree)]) == [ServerChoice("master", source=tree), ServerChoice("shared")]
    assert _report(["--source", str(tree), "--semantics", "shared"])[1] == ServerChoice("shared", source=tree)
    assert _report(["--server-bin", str(binary), "--semantics", "master"]) == [
        ServerChoice("master", binary=binary),
        ServerChoice("shared"),
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--semantics", "shared"], "--semantics says which side --source or --server-bin stands for"),
        (["--source", "TREE", "--server-bin", "/bin/true", "--semantics", "shared"], "are alternatives: give one"),
        (["--source", "/nonexistent"], "--source /nonexistent: not a directory"),
        (["--source", "EMPTY"], "has no readable common/common.h; say --semantics shared|master"),
        (["--server-bin", "/bin/true"], "--server-bin needs --semantics shared|master"),
        (["--server-bin", "/nonexistent", "--semantics", "master"], "--server-bin /nonexistent: no such file"),
    ],
)
def test_report_refuses_a_contradiction_in_one_line(tmp_path: Path, argv: list[str], message: str) -> None:
    names = {"TREE": str(_tree(tmp_path / "tree")), "EMPTY": str(tmp_path)}
    with pytest.raises(UsageError, match=re.escape(message)):
        _report([names.get(a, a) for a in argv])


def test_oom_runs_the_pinned_builds_asked_for_and_adds_a_tree_under_its_own_semantics(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "tree")
    assert resolve_servers(_args(oom, []), "add") == [ServerChoice("shared"), ServerChoice("master")]
    twice = _args(oom, ["--semantics", "master", "--semantics", "master"])
    assert resolve_servers(twice, "add") == [ServerChoice("master")] * 2
    # --semantics names the pinned builds here: the tree is master's whatever is asked for
    with_tree = _args(oom, ["--semantics", "shared", "--source", str(tree)])
    assert resolve_servers(with_tree, "add") == [ServerChoice("shared"), ServerChoice("master", source=tree)]


def test_oom_refuses_a_tree_it_cannot_read_before_building_anything(tmp_path: Path) -> None:
    unread = _tree(tmp_path / "tree", header="struct something_else {};\n")
    with pytest.raises(UsageError, match=r"^--source .*: cannot tell its semantics \(no definition of struct"):
        resolve_servers(_args(oom, ["--source", str(unread)]), "add")
    with pytest.raises(UsageError, match=r"is not a llama\.cpp tree"):
        resolve_servers(_args(oom, ["--source", str(tmp_path)]), "add")
