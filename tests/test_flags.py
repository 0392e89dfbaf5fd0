"""``harness.trees.flags``: the tree-dependent flags an older ``llama-server`` does not know are dropped from its
command line, read from its ``--help``; the pinned build keeps every one."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from harness.trees.build import build_server
from harness.trees.flags import OPTIONAL, adapt_args, knows

ARGS = ["-m", "m.gguf", "-md", "d.gguf", "--spec-type", "draft-simple", "-cms", "64", "-b", "256",
        "--no-cache-idle-slots", "-lv", "4"]  # fmt: skip

#: the lines of b9093's ``llama-server --help`` that matter here (its common/arg.cpp: no -cms, and --spec-type
#: with n-gram types only)
B9093_HELP = """\
-ctxcp, --ctx-checkpoints, --swa-checkpoints N
                                        max number of context checkpoints to create per slot (default: 32)
-cpent, --checkpoint-every-n-tokens N   create a checkpoint every n tokens during prefill (processing), -1 to
--spec-type [none|ngram-cache|ngram-simple|ngram-map-k|ngram-map-k4v|ngram-mod]
--cache-idle-slots, --no-cache-idle-slots
"""


def _binary(tmp_path: Path, help_text: str) -> Path:
    """An executable that prints ``help_text`` for ``--help``, as a llama-server does."""
    (tmp_path / "help.txt").write_text(help_text)
    b = tmp_path / "llama-server"
    b.write_text(f"#!/bin/sh\ncat {tmp_path / 'help.txt'}\n")
    b.chmod(b.stat().st_mode | stat.S_IEXEC)
    return b


def test_an_older_server_runs_without_the_flags_it_does_not_know(tmp_path: Path) -> None:
    binary = _binary(tmp_path, B9093_HELP)
    kept, dropped = adapt_args(binary, ARGS)
    assert dropped == ["--spec-type draft-simple", "-cms 64"]
    assert kept == ["-m", "m.gguf", "-md", "d.gguf", "-b", "256", "--no-cache-idle-slots", "-lv", "4"]
    assert knows(binary, "--spec-type") and not knows(binary, "--spec-type", "draft-simple")
    assert not knows(binary, "-cms") and not knows(binary, "-cpe")  # a word's prefix is not the flag


def test_a_binary_with_no_help_to_read_is_started_as_given(tmp_path: Path) -> None:
    kept, dropped = adapt_args(_binary(tmp_path, ""), ARGS)
    assert kept == ARGS and dropped == []


@pytest.mark.llama_server_builds
def test_the_pinned_build_knows_every_optional_flag() -> None:
    binary = build_server("shared")
    kept, dropped = adapt_args(binary, ARGS)
    assert kept == ARGS and dropped == [] and all(knows(binary, f) for f in OPTIONAL)
