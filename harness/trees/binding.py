"""A tree's libllama bound with cffi in API mode: the functions the harness calls, declared from its own header.

:data:`CALLS` is every libllama function the harness calls, with the number of parameters it passes. For a tree,
:func:`binding` copies each one's prototype from the tree's ``include/llama.h`` (``LLAMA_API`` and ``DEPRECATED``
taken away), declares the three structs the harness fills partially (:data:`MEMBERS`, with the header's own member
types, then ``...;``) and the scalar typedefs as integers of the compiler's width; :func:`bind` compiles that module
against the tree's headers and links it to the tree's ``libllama.so``, cached by the header and the library's place.
So a struct that grew a member, a parameter whose type changed or an enum renumbered is absorbed by the compiler;
a function the harness needs that the header lacks, or one that takes another number of parameters than the
harness passes, is refused in one :class:`~harness.errors.HarnessLimit` line naming it; a function of another API
generation (:data:`OPTIONAL`: the ``llama_batch_ext`` batch API with ``llama_process``, from between b10816 and
b11434) is left out where the header lacks it. :mod:`harness.trees.driver` loads the module.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import HarnessLimit, UsageError
from harness.trees.semantics import blank_comments
from harness.trees.tree import cache_root, file_lock

__all__ = ["CALLS", "MEMBERS", "OPTIONAL", "Binding", "arity", "bind", "binding", "members", "prototypes", "refusal"]

#: Every libllama function the harness calls, with the number of parameters it passes (upstream's names,
#: ``include/llama.h`` at 0c1e570). A tree whose header declares one with another count cannot be driven.
CALLS: dict[str, int] = {
    "llama_backend_init": 0,
    "llama_model_default_params": 0,
    "llama_model_load_from_file": 2,
    "llama_model_free": 1,
    "llama_model_get_vocab": 1,
    "llama_model_meta_val_str": 4,
    "llama_model_n_swa": 1,
    "llama_model_n_ctx_train": 1,
    "llama_model_is_recurrent": 1,
    "llama_model_is_hybrid": 1,
    "llama_vocab_n_tokens": 1,
    "llama_context_default_params": 0,
    "llama_init_from_model": 2,
    "llama_free": 1,
    "llama_n_ctx": 1,
    "llama_n_rs_seq": 1,
    "llama_get_memory": 1,
    "llama_memory_clear": 2,
    "llama_memory_seq_rm": 4,
    "llama_memory_seq_cp": 5,
    "llama_memory_seq_keep": 2,
    "llama_memory_seq_add": 5,
    "llama_memory_seq_div": 5,
    "llama_memory_seq_pos_min": 2,
    "llama_memory_seq_pos_max": 2,
    "llama_memory_can_shift": 1,
    "llama_state_seq_get_size": 2,
    "llama_state_seq_get_data": 4,
    "llama_state_seq_set_data": 4,
    "llama_state_seq_get_size_ext": 3,
    "llama_state_seq_get_data_ext": 5,
    "llama_state_seq_set_data_ext": 5,
    "llama_batch_init": 3,
    "llama_batch_free": 1,
    "llama_decode": 2,
    "llama_get_logits_ith": 2,
    # the batch API of trees from between b10816 and b11434 (the traced server's own calls, replayed as it made them)
    "llama_batch_ext_init": 1,
    "llama_batch_ext_free": 1,
    "llama_batch_ext_clear": 1,
    "llama_batch_ext_add_token": 3,
    "llama_batch_ext_set_pos": 3,
    "llama_batch_ext_add_seq": 3,
    "llama_batch_ext_set_output_logits": 3,
    "llama_process": 3,
}

#: Functions a tree may lack: another API generation's, or ones upstream added within the registry's range
#: (``llama_n_rs_seq`` after b9093). A caller asks :meth:`Driver.has` first.
OPTIONAL = frozenset({"llama_n_rs_seq"} | {n for n in CALLS if n.startswith("llama_batch_ext_")} | {"llama_process"})

#: The struct members the harness sets or reads, declared with the header's own types (the rest: ``...;``).
MEMBERS: dict[str, tuple[str, ...]] = {
    # the members the backend and the contract set, then the ones trace replay copies from the traced context
    "llama_context_params": (
        *("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads", "n_threads_batch", "no_perf", "swa_full"),
        *("kv_unified", "n_rs_seq", "n_outputs_max", "n_outputs_max_per_seq", "ctx_type", "rope_scaling_type"),
        *("pooling_type", "attention_type", "flash_attn_type", "yarn_orig_ctx", "type_k", "type_v", "embeddings"),
        *("rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast"),
        *("yarn_beta_slow", "offload_kqv", "op_offload"),
    ),
    "llama_model_params": (),
    "llama_batch": ("n_tokens", "token", "embd", "pos", "n_seq_id", "seq_id", "logits"),
}

#: The scalar typedefs of the prototypes: integers whose width the compiler decides.
SCALARS = ("llama_token", "llama_pos", "llama_seq_id", "llama_state_seq_flags")

_QUIET = """
static void harness_quiet_cb(enum ggml_log_level level, const char * text, void * user_data) {
    (void) level; (void) text; (void) user_data;
}
static void harness_quiet_logs(void) { llama_log_set(harness_quiet_cb, NULL); }
"""


def _close(text: str, start: int) -> int:
    """The index of the parenthesis closing the one at ``start``."""
    depth = 0
    for k in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[k], 0)
        if depth == 0:
            return k
    return len(text)


def prototypes(header: str) -> dict[str, str]:
    """Every ``LLAMA_API`` function of a header as a plain C declaration (``DEPRECATED`` and ``LLAMA_API`` taken
    away): name -> ``"int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);"``."""
    text = blank_comments(header)
    out: dict[str, str] = {}
    for m in re.finditer(r"\bLLAMA_API\b([^;{()]*?)\b(llama_\w+)\s*\(", text):
        end = _close(text, m.end() - 1)
        ret = " ".join(m.group(1).split())
        params = " ".join(text[m.end() : end].split())
        out.setdefault(m.group(2), f"{ret} {m.group(2)}({params or 'void'});")
    return out


def arity(declaration: str) -> int:
    """How many parameters a declaration of :func:`prototypes` takes."""
    params = declaration[declaration.index("(") + 1 : declaration.rindex(")")].strip()
    if params in ("", "void"):
        return 0
    depth, n = 0, 1
    for c in params:
        depth += {"(": 1, ")": -1}.get(c, 0)
        n += c == "," and depth == 0
    return n


def members(header: str, struct: str, wanted: tuple[str, ...]) -> list[str]:
    """The declarations of ``wanted`` members of ``struct`` as the header writes them (``"uint32_t n_ctx;"``);
    a member the header lacks is left out (the caller that sets it says so)."""
    text = blank_comments(header)
    m = re.search(r"\bstruct\s+" + struct + r"\s*\{", text)
    if m is None:
        return []
    body = text[m.end() : text.index("};", m.end())]
    out = []
    for name in wanted:
        d = re.search(r"(?m)^\s*([A-Za-z_][\w\s\*]*?[\s\*])" + name + r"\s*;", body)
        if d is not None:
            out.append(" ".join(d.group(1).split()) + " " + name + ";")
    return out


@dataclass(frozen=True)
class Binding:
    """What :func:`bind` compiles: the cdef, the functions left out (another generation) and the refusals."""

    cdef: str
    absent: tuple[str, ...]
    refused: tuple[str, ...]


def binding(header: str) -> Binding:
    """The cffi declarations of :data:`CALLS` for ``header`` (the text of a tree's ``include/llama.h``)."""
    protos = prototypes(header)
    decls: list[str] = []
    absent: list[str] = []
    refused: list[str] = []
    for name, n in CALLS.items():
        proto = protos.get(name)
        if proto is None and name in OPTIONAL:
            absent.append(name)
        elif proto is None:
            refused.append(f"{name} is not in llama.h")
        elif arity(proto) != n:
            refused.append(f"{name} takes {arity(proto)} parameters in llama.h, the harness passes {n}")
        else:
            decls.append(proto)
    fields = {s: members(header, s, wanted) for s, wanted in MEMBERS.items()}
    used = " ".join(decls + [m for ms in fields.values() for m in ms])
    lines = [f"typedef int... {t};" for t in SCALARS if re.search(r"\b" + t + r"\b", used)]
    if "llama_memory_t" in used:
        lines.append("typedef struct llama_memory_i * llama_memory_t;")
    partial = set(MEMBERS)
    for s in sorted(set(re.findall(r"\bstruct\s+(\w+)", used)) - partial):
        lines.append(f"struct {s};")
    for e in sorted(set(re.findall(r"\benum\s+(\w+)", used))):
        lines.append(f"enum {e} {{ ... }};")
    for s, ms in fields.items():
        lines.append(f"struct {s} {{ {' '.join(ms)} ...; }};")
    lines += decls
    lines.append("void harness_quiet_logs(void);")
    return Binding("\n".join(lines) + "\n", tuple(absent), tuple(refused))


def refusal(tree: Path, b: Binding) -> str:
    return (
        f"the harness cannot drive the libllama of {tree}: "
        + "; ".join(b.refused)
        + f"; the server backend still tests this tree (--backend server --source {tree})"
    )


def _key(tree: Path, lib_dir: Path, cdef: str) -> str:
    import cffi

    h = hashlib.sha256()
    for part in (cdef, _QUIET, str(lib_dir.resolve()), cffi.__version__, sys.version, sys.platform):
        h.update(part.encode() + b"\0")
    for header in ("include/llama.h", "ggml/include/ggml.h"):
        with contextlib.suppress(OSError):
            h.update((tree / header).read_bytes())
    return h.hexdigest()[:16]


def _compile(tree: Path, lib_dir: Path, b: Binding, module: str, out: Path) -> Path:
    import cffi

    ffi = cffi.FFI()
    try:
        ffi.cdef(b.cdef)
    except cffi.CDefError as e:
        raise HarnessLimit(
            f"the functions the harness calls in {tree}/include/llama.h cannot be declared: {e}"
        ) from None
    ffi.set_source(module, '#include "llama.h"\n' + _QUIET,
                   include_dirs=[str(tree / "include"), str(tree / "ggml" / "include")],
                   library_dirs=[str(lib_dir)], libraries=["llama"],
                   extra_compile_args=["-w"], extra_link_args=[f"-Wl,-rpath,{lib_dir.resolve()}"])  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="driver-") as tmp:
        try:
            built = Path(ffi.compile(tmpdir=tmp, verbose=False))
        except Exception as e:  # cffi raises distutils' errors; the compiler said why on stderr
            raise HarnessLimit(f"the libllama driver does not compile against {tree}/include/llama.h: {e}") from None
        out.mkdir(parents=True, exist_ok=True)
        final = out / built.name
        shutil.copy2(built, final.with_suffix(".tmp"))
        os.replace(final.with_suffix(".tmp"), final)
    return final


def bind(tree: Path, lib_dir: Path, *, log: Any = lambda _m: None) -> Path:
    """Compile (once, cached by the header and the library's place) the cffi driver of ``tree``'s libllama in
    ``lib_dir``; its path, for :func:`use_driver`. One :class:`HarnessLimit` line names what cannot be driven."""
    try:
        header = (tree / "include" / "llama.h").read_text(errors="replace")
    except OSError as e:
        raise UsageError(f"no readable include/llama.h in {tree}: {e}") from None
    if not (lib_dir / "libllama.so").is_file():
        raise UsageError(f"no libllama.so in {lib_dir}")
    b = binding(header)
    if b.refused:
        raise HarnessLimit(refusal(tree, b))
    key = _key(tree, lib_dir, b.cdef)
    out = cache_root() / "driver" / key
    module = f"_llama_driver_{key}"
    with file_lock(cache_root() / "driver" / f".{key}.lock"):
        found = sorted(out.glob(f"{module}*.so")) if out.is_dir() else []
        if found:
            return found[0]
        log(f"binding libllama's {len(CALLS) - len(b.absent)} functions from {tree}/include/llama.h (cffi)")
        return _compile(tree, lib_dir, b, module, out)
