"""The tiny generated GGUF models in ``fixtures`` are deterministic, small, and load and decode in llama-cpp-python."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from faults.native import cache_dir as native_cache_dir
from fixtures import (
    ARCHS,
    BOS_ID,
    BYTE_TOKEN_OFFSET,
    DRAFT,
    SPACE_ID,
    SPECS,
    VOCAB_SIZE,
    draft_path,
    model_path,
)
from fixtures import gguf as gguf_fixture
from harness.errors import ModelLoadError

if TYPE_CHECKING:
    from llama_cpp import Llama

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[1]

NAMES = (*ARCHS, "draft")


def _path(name: str, cache_dir: Path, seed: int = 0) -> Path:
    if name == "draft":
        return draft_path(seed=seed, cache_dir=cache_dir)
    return model_path(name, seed=seed, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def _field_str(reader: gguf.GGUFReader, key: str) -> str:
    field = reader.get_field(key)
    assert field is not None, key
    return bytes(field.parts[field.data[0]]).decode()


def _field_int(reader: gguf.GGUFReader, key: str) -> int:
    field = reader.get_field(key)
    assert field is not None, key
    return int(field.parts[field.data[0]][0])


# ---------------------------------------------------------------------------------------------------------------
# generation: pure Python, no llama.cpp needed
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_generated_deterministic_and_small(name: str, tmp_path: Path) -> None:
    a = _path(name, tmp_path / "a")
    b = _path(name, tmp_path / "b")
    c = _path(name, tmp_path / "c", seed=1)
    assert a.is_file() and a.name == b.name
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert a.stat().st_size < 1_000_000
    # cached: a second call returns the same file without rewriting it
    mtime = a.stat().st_mtime_ns
    assert _path(name, tmp_path / "a") == a
    assert a.stat().st_mtime_ns == mtime
    # no temporary files left behind: the model and its recorded sha256
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [a.name, a.name + ".sha256"]


@pytest.mark.parametrize("name", NAMES)
def test_metadata_read_back(name: str, cache_dir: Path) -> None:
    spec = DRAFT if name == "draft" else SPECS[name]
    reader = gguf.GGUFReader(_path(name, cache_dir))
    arch = _field_str(reader, "general.architecture")
    assert arch == ("llama" if name == "draft" else name)
    assert _field_int(reader, f"{arch}.context_length") == 1024
    assert _field_int(reader, f"{arch}.block_count") == spec.n_layer
    assert _field_str(reader, "tokenizer.ggml.model") == "llama"
    tokens = reader.get_field("tokenizer.ggml.tokens")
    assert tokens is not None and len(tokens.data) == VOCAB_SIZE


def test_same_vocab_everywhere(cache_dir: Path) -> None:
    vocabs = set()
    for name in NAMES:
        field = gguf.GGUFReader(_path(name, cache_dir)).get_field("tokenizer.ggml.tokens")
        assert field is not None
        vocabs.add(tuple(bytes(field.parts[i]) for i in field.data))
    assert len(vocabs) == 1


def test_hybrids_have_every_layer_kind() -> None:
    assert {"mamba", "attn"} <= set(SPECS["jamba"].layers)
    assert {"shortconv", "attn"} <= set(SPECS["lfm2"].layers)
    assert {"swa", "attn"} <= set(SPECS["gemma2"].layers)
    assert SPECS["gemma2"].n_swa in (8, 16)
    assert DRAFT.n_embd < SPECS["llama"].n_embd


def test_concurrent_first_use(tmp_path: Path) -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        paths = list(pool.map(lambda _: model_path("jamba", seed=3, cache_dir=tmp_path), range(4)))
    assert len(set(paths)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [paths[0].name, paths[0].name + ".sha256"]
    assert paths[0].read_bytes() == model_path("jamba", seed=3, cache_dir=tmp_path / "solo").read_bytes()


def test_unknown_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama, mamba, jamba, lfm2, gemma2"):
        model_path("gpt2", cache_dir=tmp_path)


def test_default_cache_dir_respects_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    p = model_path("llama")
    assert p.parent == tmp_path / "prompt-cache-harness" / "models"
    assert p.is_file()


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp: load, tokenize, decode
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=NAMES)
def loaded(request: pytest.FixtureRequest, cache_dir: Path) -> Iterator[tuple[str, Llama]]:
    llama_cpp = pytest.importorskip("llama_cpp")

    model = llama_cpp.Llama(
        model_path=os.fspath(_path(request.param, cache_dir)),
        n_ctx=256,
        n_batch=64,
        n_ubatch=64,
        n_threads=1,
        n_threads_batch=1,
        logits_all=False,
        verbose=False,
    )
    try:
        yield request.param, model
    finally:
        model.close()


def test_loads_tokenizes_and_decodes(loaded: tuple[str, Llama]) -> None:
    import llama_cpp

    name, llm = loaded
    expected_arch = "llama" if name == "draft" else name
    assert llm.metadata["general.architecture"] == expected_arch
    assert llm.n_vocab() == VOCAB_SIZE
    assert llm.n_ctx() == 256

    text = b"hello world"
    toks = llm.tokenize(text)
    assert toks[0] == BOS_ID
    expected = [SPACE_ID if b == ord(" ") else BYTE_TOKEN_OFFSET + b for b in text]
    assert toks[1:] == expected
    assert llm.detokenize(toks) == text

    llm.reset()
    llm.eval(toks)
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    logits = np.ctypeslib.as_array(ptr, shape=(VOCAB_SIZE,)).copy()
    assert np.isfinite(logits).all()
    assert float(logits.std()) > 1e-3

    # the sequence has state to save (KV cells and/or recurrent state)
    assert llama_cpp.llama_state_seq_get_size(llm.ctx, 0) > 0


def test_architecture_via_low_level_api(loaded: tuple[str, Llama]) -> None:
    import llama_cpp

    _, llm = loaded
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_model_meta_val_str(llm.model, b"general.architecture", buf, len(buf))
    assert n > 0
    assert buf.value.decode() == llm.metadata["general.architecture"]
    if buf.value.decode() in ("mamba",):
        assert llama_cpp.llama_model_is_recurrent(llm.model)
    if buf.value.decode() in ("jamba", "lfm2"):
        assert llama_cpp.llama_model_is_hybrid(llm.model)


# ---------------------------------------------------------------------------------------------------------------
# a damaged cache: regenerated with one line, or one line and exit 2 when it cannot be
# ---------------------------------------------------------------------------------------------------------------


def _corrupt(path: Path, how: str) -> None:
    if how == "truncate":
        os.truncate(path, 5000)
    else:  # overwrite tensor bytes: libllama would load it and compute with wrong weights
        with path.open("r+b") as f:
            f.seek(path.stat().st_size // 2)
            f.write(b"\xff" * 64)


@pytest.mark.parametrize("how", ["truncate", "overwrite"])
def test_corrupt_cached_model_is_regenerated(how: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = model_path("llama", cache_dir=tmp_path)
    good = p.read_bytes()
    _corrupt(p, how)
    assert model_path("llama", cache_dir=tmp_path) == p
    assert p.read_bytes() == good
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cached model {p} was corrupt" in err and "regenerated" in err


def test_model_without_record_is_checked_and_adopted_silently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = model_path("mamba", cache_dir=tmp_path)
    record = p.with_name(p.name + ".sha256")
    record.unlink()  # a cache written before hashes were recorded
    inode = p.stat().st_ino
    assert model_path("mamba", cache_dir=tmp_path) == p
    assert record.read_text().split() == [hashlib.sha256(p.read_bytes()).hexdigest(), p.name]
    assert p.stat().st_ino == inode  # the model itself was not rewritten
    assert capsys.readouterr().err == ""


def test_corrupt_model_that_cannot_be_regenerated_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = model_path("llama", cache_dir=tmp_path)
    _corrupt(p, "truncate")

    def disk_full(spec: object, seed: int, path: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(gguf_fixture, "write_model", disk_full)
    with pytest.raises(ModelLoadError) as e:
        model_path("llama", cache_dir=tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and f"{p} is corrupt" in msg and "No space left" in msg
    assert e.value.exit_code == 2
    assert [q.name for q in tmp_path.iterdir() if q.name.endswith(".tmp")] == []


def _gate_env(xdg: Path) -> dict[str, str]:
    # the models in a fresh cache; the compiled fault shim stays where it is (no rebuild)
    return dict(os.environ, XDG_CACHE_HOME=str(xdg), PROMPT_CACHE_HARNESS_CACHE=str(native_cache_dir()))


def _seeded_cache(xdg: Path) -> tuple[Path, Path]:
    models_dir = xdg / "prompt-cache-harness" / "models"
    return model_path("llama", cache_dir=models_dir), draft_path(cache_dir=models_dir)


_GATE = [sys.executable, "-m", "harness", "gate", "--backend", "llama", "--arch", "llama", "--max-examples", "3"]


def test_gate_regenerates_corrupt_cached_models_and_passes(tmp_path: Path) -> None:
    llama, draft = _seeded_cache(tmp_path)
    _corrupt(llama, "truncate")
    _corrupt(draft, "overwrite")
    r = subprocess.run(_GATE, cwd=ROOT, env=_gate_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    regenerated = [line for line in r.stderr.splitlines() if "regenerated" in line]
    assert len(regenerated) == 2, r.stderr
    assert str(llama) in regenerated[0] and str(draft) in regenerated[1]
    assert r.stdout.rstrip().endswith("PASS")


@contextlib.contextmanager
def _unwritable(d: Path) -> Iterator[Callable[[], None] | None]:
    """Make ``d`` unwritable; yields a ``preexec_fn`` for the child when only a file-size limit can (root)."""
    d.chmod(0o555)
    chattr = shutil.which("chattr")
    immutable = False
    preexec: Callable[[], None] | None = None
    try:
        (d / ".probe").touch()
        (d / ".probe").unlink()
    except OSError:
        pass  # the mode bits are enough
    else:  # root ignores them: an immutable directory, else no file may grow (EFBIG: Python ignores SIGXFSZ)
        if chattr and subprocess.run([chattr, "+i", str(d)], capture_output=True).returncode == 0:
            immutable = True
        else:
            preexec = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # noqa: E731
    try:
        yield preexec
    finally:
        if immutable:
            subprocess.run([chattr or "chattr", "-i", str(d)], check=True)
        d.chmod(0o755)


def test_gate_on_corrupt_model_in_unwritable_cache_fails_with_one_line(tmp_path: Path) -> None:
    llama, _ = _seeded_cache(tmp_path)
    _corrupt(llama, "truncate")
    with _unwritable(llama.parent) as preexec:
        r = subprocess.run(
            _GATE, cwd=ROOT, env=_gate_env(tmp_path), capture_output=True, text=True, timeout=600, preexec_fn=preexec
        )
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: tiny model {llama} is corrupt") and "cannot be (re)generated" in lines[0]
