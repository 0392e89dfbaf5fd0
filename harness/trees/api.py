"""Can llama-cpp-python 0.3.36 drive a tree's own ``libllama``? Its C API against the bindings', before loading it.

The libllama backend, the contract machine and the native fault sweep run libllama through llama-cpp-python,
whose ``ctypes`` bindings were written for the vendored llama.cpp 0c1e570. Handed another tree's library
(``LLAMA_CPP_LIB_PATH``), a function renamed away is an ``AttributeError`` at import, and a struct whose
layout moved, a parameter added or an enum renumbered is silent memory corruption. So before the library is
loaded, :func:`check_libllama` compares:

* **functions**: every function the bindings bind must be exported by the built ``libllama.so``
  (``nm -D``), with as many parameters in the tree's ``include/llama.h`` as the binding's ``argtypes``;
* **structs**: every struct the bindings define that the pinned ``llama.h`` defines too, by size and by
  each field's offset and size, measured by compiling a probe against the tree's headers;
* **constants**: every ``LLAMA_*`` integer of the bindings that the pinned ``llama.h`` declares, by value.

What the bindings bind is read in a child process that imports llama-cpp-python with its own library
(:func:`bindings`, cached per installed version). A difference is one :class:`~harness.errors.UsageError`
line naming what differs (exit 2), never a crash. :func:`use_libllama` then points this process (and the
children it starts) at the library, and :func:`loaded_libllama` says which one a process really mapped.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import UsageError
from harness.trees.semantics import blank_comments
from harness.trees.tree import cache_root

__all__ = ["ApiCheck", "bindings", "check_libllama", "loaded_libllama", "use_libllama"]

LIB_ENV = "LLAMA_CPP_LIB_PATH"


def _bindings_source() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("llama-cpp-python is not installed: pip install llama-cpp-python==0.3.36")
    return Path(next(iter(spec.submodule_search_locations))) / "llama_cpp.py"


def _dump() -> dict[str, Any]:  # pragma: no cover - runs in the child
    import ctypes

    import llama_cpp.llama_cpp as b

    functions: dict[str, int] = {}
    structs: dict[str, Any] = {}
    constants: dict[str, int] = {}
    for name, obj in vars(b).items():
        if isinstance(obj, ctypes._CFuncPtr) and name.startswith("llama_"):  # type: ignore[attr-defined]
            functions[name] = len(obj.argtypes or ())
        elif isinstance(obj, type) and issubclass(obj, ctypes.Structure) and obj.__module__ == b.__name__:
            fields = []
            for f in obj._fields_:
                fname, ftype = f[0], f[1]
                desc = getattr(obj, fname)
                c_name = fname
                if isinstance(ftype, type) and issubclass(ftype, ctypes.Union):
                    c_name = ftype._fields_[0][0]  # an anonymous union in C: name its first member
                fields.append([fname, c_name, desc.offset, desc.size])
            structs[name] = {"size": ctypes.sizeof(obj), "fields": fields}
        elif isinstance(obj, int) and not isinstance(obj, bool) and re.fullmatch(r"LLAMA_[A-Z0-9_]+", name):
            constants[name] = obj
    return {"functions": functions, "structs": structs, "constants": constants}


def bindings() -> dict[str, Any]:
    """What llama-cpp-python binds: functions (name -> number of parameters), structs (size, fields as
    ``[python name, C member, offset, size]``) and ``LLAMA_*`` constants; cached per installed file."""
    src = _bindings_source()
    key = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    cached = cache_root() / "api" / f"bindings-{key}.json"
    try:
        return dict(json.loads(cached.read_text()))
    except (OSError, ValueError):
        pass
    env = {k: v for k, v in os.environ.items() if k != LIB_ENV}  # the package's own library
    proc = subprocess.run([sys.executable, "-m", "harness.trees.api", "--dump"], capture_output=True,
                          text=True, env=env, timeout=120, check=False)  # fmt: skip
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-2:])
        raise UsageError(f"cannot read llama-cpp-python's bindings (import failed: {tail})")
    data: dict[str, Any] = json.loads(proc.stdout)
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(data))
    return data


@dataclass(frozen=True)
class ApiCheck:
    """What :func:`check_libllama` compared and what differs (empty: the bindings can drive the library)."""

    functions: int
    structs: int
    constants: int
    differences: tuple[str, ...]

    def line(self) -> str:
        said = f"{self.functions} functions, {self.structs} structs, {self.constants} constants"
        if not self.differences:
            return f"the C API matches llama-cpp-python's bindings ({said})"
        more = len(self.differences) - 5
        shown = "; ".join(self.differences[:5]) + (f"; and {more} more" if more > 0 else "")
        return f"{len(self.differences)} differences from llama-cpp-python's bindings ({said} compared): {shown}"


def _exported(lib: Path) -> set[str] | None:
    nm = shutil.which("nm")
    if nm is None:
        return None
    proc = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=False,
                          timeout=60)  # fmt: skip
    if proc.returncode != 0:
        return None
    return {line.split()[-1].split("@")[0] for line in proc.stdout.splitlines() if line.strip()}


def _prototypes(header: str) -> dict[str, int]:
    """``LLAMA_API`` function declarations of a header: name -> number of parameters."""
    text = blank_comments(header)
    out: dict[str, int] = {}
    for m in re.finditer(r"\bLLAMA_API\b[^;{]*?\b(llama_\w+)\s*\(", text):
        start = m.end() - 1
        depth, k = 0, start
        while k < len(text):
            depth += {"(": 1, ")": -1}.get(text[k], 0)
            if depth == 0:
                break
            k += 1
        params = text[start + 1 : k].strip()
        if params in ("", "void"):
            out[m.group(1)] = 0
            continue
        depth, n = 0, 1
        for c in params:
            depth += {"(": 1, ")": -1, "<": 0}.get(c, 0)
            n += c == "," and depth == 0
        out[m.group(1)] = n
    return out


def _declared(header: str, name: str) -> bool:
    return re.search(r"\b" + re.escape(name) + r"\b", header) is not None


def _probe_source(structs: Mapping[str, Any], constants: Mapping[str, int], skip: set[str]) -> str:
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "llama.h"', "int main(void) {"]
    for s, info in structs.items():
        if s in skip:
            continue
        lines.append(f'    printf("S {s} %zu\\n", sizeof(struct {s}));')
        for _py, c, _off, _size in info["fields"]:
            if f"{s}.{c}" in skip:
                continue
            field = f"offsetof(struct {s}, {c}), sizeof(((struct {s} *)0)->{c})"
            lines.append(f'    printf("F {s} {c} %zu %zu\\n", {field});')
    for c in constants:
        if c not in skip:
            lines.append(f'    printf("C {c} %lld\\n", (long long)({c}));')
    lines += ["    return 0;", "}"]
    return "\n".join(lines) + "\n"


_UNDEFINED = re.compile(
    r"(?:invalid application of .sizeof. to incomplete type|invalid use of undefined type) [‘']struct (\w+)"
)


def _measure(tree: Path, structs: Mapping[str, Any], constants: Mapping[str, int]) -> tuple[dict[str, Any], list[str]]:
    """Compile and run the layout probe against ``tree``'s headers: what it printed, and what does not exist."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise UsageError("no C compiler (cc, gcc or clang) to measure the tree's struct layouts")
    incs = ["-I", str(tree / "include"), "-I", str(tree / "ggml" / "include")]
    skip: set[str] = set()
    missing: list[str] = []
    with tempfile.TemporaryDirectory(prefix="api-probe-") as tmp:
        for _ in range(4):  # each round drops what did not compile
            src = Path(tmp) / "probe.c"
            src.write_text(_probe_source(structs, constants, skip))
            proc = subprocess.run([cc, "-w", *incs, str(src), "-o", str(Path(tmp) / "probe")], capture_output=True,
                                  text=True, check=False, timeout=120)  # fmt: skip
            if proc.returncode == 0:
                run = subprocess.run([str(Path(tmp) / "probe")], capture_output=True, text=True, check=False,
                                     timeout=30)  # fmt: skip
                measured: dict[str, Any] = {}
                for line in run.stdout.splitlines():
                    kind, name, *vals = line.split()
                    if kind == "F":
                        name, vals = f"{name}.{vals[0]}", vals[1:]
                    measured[name] = [int(v) for v in vals]
                return measured, missing
            before = len(skip)
            for m in re.finditer(r"struct (\w+)[’'] has no member named [‘'](\w+)", proc.stderr):
                skip.add(f"{m.group(1)}.{m.group(2)}")
                missing.append(f"struct {m.group(1)} has no member {m.group(2)}")
            for m in re.finditer(r"[‘'](LLAMA_\w+)[’'] undeclared", proc.stderr):
                skip.add(m.group(1))
                missing.append(f"{m.group(1)} is not declared")
            for m in _UNDEFINED.finditer(proc.stderr):
                skip.add(m.group(1))
                missing.append(f"struct {m.group(1)} is not defined")
            if len(skip) == before:
                tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
                raise UsageError(f"the tree's include/llama.h does not compile as the bindings use it: {tail}")
    raise UsageError("the tree's include/llama.h differs from the bindings in too many places to measure")


def _differences(tree: Path, header: str, b: Mapping[str, Any], structs: Mapping[str, Any],
                 constants: Mapping[str, int]) -> list[str]:  # fmt: skip
    """Where the tree's ``llama.h`` (prototypes and measured layouts) differs from the bindings."""
    diffs: list[str] = []
    protos = _prototypes(header)
    for name, nargs in sorted(b["functions"].items()):
        if name in protos and protos[name] != nargs:
            diffs.append(f"{name} takes {protos[name]} parameters in llama.h, {nargs} in the bindings")
    measured, missing = _measure(tree, structs, constants)
    diffs += dict.fromkeys(missing)  # the compiler names a missing member once per use
    for s, info in structs.items():
        if s in measured and measured[s][0] != info["size"]:
            diffs.append(f"struct {s} is {measured[s][0]} bytes, {info['size']} in the bindings")
        for py, c, off, size in info["fields"]:
            got = measured.get(f"{s}.{c}")
            if got is None:
                continue
            if got[0] != off or (py == c and got[1] != size):  # an anonymous union: its first member's offset
                diffs.append(f"{s}.{py} is at offset {got[0]} (size {got[1]}), at {off} (size {size}) in the bindings")
    for c, v in constants.items():
        if c in measured and measured[c][0] != v:
            diffs.append(f"{c} is {measured[c][0]}, {v} in the bindings")
    return diffs


def check_libllama(lib_dir: Path, tree: Path, pinned: Path) -> ApiCheck:
    """Compare the C API of ``lib_dir/libllama.so`` (built from ``tree``) with what llama-cpp-python binds.

    ``pinned`` is the pinned tree: the structs and constants its ``include/llama.h`` declares are the ones the
    bindings mirror (the others are the bindings' own helpers), and a difference the bindings already have
    from the pinned tree itself (llama-cpp-python 0.3.36's ``llama_opt_params`` is 8 bytes short) is how
    llama-cpp-python drives its own library, not a difference of ``tree``'s."""
    b = bindings()
    try:
        header = (tree / "include" / "llama.h").read_text(errors="replace")
        pinned_header = (pinned / "include" / "llama.h").read_text(errors="replace")
    except OSError as e:
        raise UsageError(f"no readable include/llama.h: {e}") from None
    structs = {s: v for s, v in b["structs"].items() if re.search(r"\bstruct\s+" + s + r"\s*\{", pinned_header)}
    constants = {c: v for c, v in b["constants"].items() if _declared(pinned_header, c)}
    own = set(_differences(pinned, pinned_header, b, structs, constants))
    diffs = [d for d in _differences(tree, header, b, structs, constants) if d not in own]
    exported = _exported(lib_dir / "libllama.so")
    if exported is not None:
        diffs = [f"{name} is not exported" for name in sorted(b["functions"]) if name not in exported] + diffs
    return ApiCheck(len(b["functions"]), len(structs), len(constants), tuple(diffs))


def loaded_libllama() -> Path | None:
    """The ``libllama.so`` this process has mapped (None: none yet)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if len(line.split()) >= 6 else ""
        if re.search(r"/libllama\.so(\.\d+)*$", path):
            return Path(path)
    return None


def use_libllama(lib_dir: Path) -> None:
    """Point llama-cpp-python (in this process and every child it starts) at ``lib_dir/libllama.so``;
    refused when this process has loaded another libllama already (a process holds one)."""
    loaded = loaded_libllama()
    if loaded is not None and loaded.parent.resolve() != lib_dir.resolve():
        raise UsageError(f"this process already runs libllama from {loaded}: start a new one for {lib_dir}")
    os.environ[LIB_ENV] = str(lib_dir)


if __name__ == "__main__":  # pragma: no cover - the child of :func:`bindings`
    if sys.argv[1:] == ["--dump"]:
        print(json.dumps(_dump()))
