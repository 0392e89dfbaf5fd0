"""The tiny generated GGUF models in ``fixtures`` are deterministic, small, and load and decode in llama-cpp-python."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from fixtures import ARCHS, BOS_ID, BYTE_TOKEN_OFFSET, DRAFT, SPACE_ID, SPECS, VOCAB_SIZE, draft_path, model_path

if TYPE_CHECKING:
    from llama_cpp import Llama

gguf = pytest.importorskip("gguf")

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
    # no temporary files left behind
    assert [p.name for p in (tmp_path / "a").iterdir()] == [a.name]


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
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]
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
