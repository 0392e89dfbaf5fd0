"""docs/commands.md is generated from the argparse definitions (``python -m ci.command_docs``) and kept so:
a flag added, removed or re-described without regenerating it fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ci.command_docs import DOC, main, python_version, render
from harness.cli import COMMANDS


def test_docs_commands_md_is_the_parsers_help() -> None:
    text = DOC.read_text()
    rendered_with = re.search(r"argparse definitions \(Python (\d+\.\d+)\)", text)
    assert rendered_with, "docs/commands.md has lost its generated header: run python -m ci.command_docs"
    if rendered_with.group(1) != python_version():
        pytest.skip(f"rendered with Python {rendered_with.group(1)}; argparse lays help out differently here")
    assert text == render(), "docs/commands.md is out of date with the parser: run python -m ci.command_docs"


def test_every_subcommand_and_every_flag_is_in_the_reference() -> None:
    text = render()
    for name in COMMANDS:
        assert f"\n## python -m harness {name}\n" in text, name
    assert "\n## python -m ci.gate_seeds\n" in text
    assert "--source DIR" in text and "--db DB" in text and "--quick" in text


def test_the_help_does_not_follow_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    narrow = render()
    monkeypatch.setenv("COLUMNS", "300")
    assert render() == narrow


def test_check_says_when_the_file_is_stale(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    stale = tmp_path / "commands.md"
    stale.write_text("# Command reference\n")
    monkeypatch.setattr("ci.command_docs.DOC", stale)
    assert main(["--check"]) == 1
    assert main([]) == 0 and main(["--check"]) == 0
    assert stale.read_text() == render()
