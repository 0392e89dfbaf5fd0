"""The libllama driver: the C functions the harness calls, bound from a tree's own ``include/llama.h``.

The libllama backend, the contract machine, the native fault sweep and trace replay call about forty libllama
functions (:data:`CALLS`) and fill three structs (``llama_context_params``, ``llama_model_params``,
``llama_batch``). Two drivers give them the same face (:class:`Driver`: each function by its C name, and four
memory helpers):

* :class:`BoundDriver`, **cffi in API mode**: a module compiled against the tree's own headers and linked to its
  ``libllama.so`` (:mod:`harness.trees.binding`: a struct that grew a member, as b11549's ``llama_context_params``
  did with ``moe_cache_size``, is absorbed by the compiler; what cannot be driven is refused in one line naming
  the function). A function of another API generation (the ``llama_batch_ext`` batch API with ``llama_process``,
  in trees from between b10816 and b11434) is bound where the header has it; :meth:`Driver.has` says which
  generation a tree is.
* :class:`PackageDriver`: llama-cpp-python's own ``ctypes`` bindings, on the library it vendors (the pinned
  tree, 0c1e570). It is the user's runtime, and the subject of the llama-cpp-python caches' backend.

A process holds one driver (:func:`libllama`): the bound module named by ``HARNESS_LIBLLAMA_DRIVER`` (set by
:func:`use_driver`, inherited by the children it starts), else llama-cpp-python's.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from harness.errors import HarnessLimit, UsageError
from harness.trees.binding import CALLS, bind, binding, refusal
from harness.trees.build import server_build
from harness.trees.tree import check_tree

__all__ = [
    "DRIVER_ENV",
    "BoundDriver",
    "Driver",
    "DriverMissing",
    "PackageDriver",
    "libllama",
    "libllama_of",
    "use_driver",
]

DRIVER_ENV = "HARNESS_LIBLLAMA_DRIVER"


class DriverMissing(HarnessLimit, AttributeError):
    """A function the tree's libllama does not have (another API generation): a limit, never a crash."""


class Driver:
    """What a libllama caller holds: each function of :data:`CALLS` as an attribute by its C name, and the memory
    helpers a call needs (a byte buffer to fill, one holding bytes, the bytes at a pointer)."""

    name = "libllama"

    _lib: Any  # the bound functions: llama-cpp-python's module or the cffi module's ``lib``

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return getattr(self._lib, name)
        except AttributeError:
            raise DriverMissing(f"{self.name} has no {name}") from None

    def has(self, name: str) -> bool:
        try:
            getattr(self, name)
        except AttributeError:
            return False
        return True

    def buffer(self, size: int) -> Any:
        raise NotImplementedError

    def buffer_of(self, data: bytes) -> Any:
        raise NotImplementedError

    def bytes_at(self, ptr: Any, size: int) -> bytes:
        raise NotImplementedError

    def int32s(self, size: int) -> Any:
        """An array of ``size`` zeroed ``int32_t`` (positions, ``llama_pos``)."""
        raise NotImplementedError

    def quiet_logs(self) -> None:
        raise NotImplementedError

    def meta(self, model: Any, key: str) -> str | None:
        """A model's metadata string (``llama_model_meta_val_str``), None when it has no ``key``."""
        raise NotImplementedError


class PackageDriver(Driver):
    """llama-cpp-python's ``ctypes`` bindings (``LLAMA_CPP_LIB_PATH`` may point them at another library the
    bindings were checked against, :mod:`harness.trees.api`)."""

    def __init__(self, module: ModuleType, version: str) -> None:
        self._lib = module
        self._cb: Any = None  # the quiet log callback, kept alive for the life of the process
        self.name = f"llama-cpp-python {version}"

    def buffer(self, size: int) -> Any:
        return (ctypes.c_uint8 * max(size, 1))()

    def buffer_of(self, data: bytes) -> Any:
        return (ctypes.c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")

    def bytes_at(self, ptr: Any, size: int) -> bytes:
        return ctypes.string_at(ptr, size)

    def int32s(self, size: int) -> Any:
        return (ctypes.c_int32 * size)()

    def quiet_logs(self) -> None:
        def _quiet(level: int, text: bytes, user: Any) -> None:
            return None

        self._cb = self._lib.llama_log_callback(_quiet)
        self._lib.llama_log_set(self._cb, ctypes.c_void_p(0))

    def meta(self, model: Any, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = int(self._lib.llama_model_meta_val_str(model, key.encode(), buf, len(buf)))
        return buf.value.decode(errors="replace") if n >= 0 else None


class BoundDriver(Driver):
    """A cffi module compiled against a tree's ``include/llama.h`` (:func:`bind`)."""

    def __init__(self, module: ModuleType, name: str) -> None:
        self._ffi = module.ffi
        self._lib = module.lib
        self.name = name
        for fn in dir(self._lib):  # cffi makes a function's object at its first use: not inside a measured call
            getattr(self._lib, fn)
        self.path = Path(str(module.__file__))

    def buffer(self, size: int) -> Any:
        return self._ffi.new("uint8_t[]", max(size, 1))

    def buffer_of(self, data: bytes) -> Any:
        buf = self._ffi.new("uint8_t[]", max(len(data), 1))
        self._ffi.memmove(buf, data, len(data))
        return buf

    def bytes_at(self, ptr: Any, size: int) -> bytes:
        out: bytes = self._ffi.unpack(self._ffi.cast("char *", ptr), size)
        return out

    def int32s(self, size: int) -> Any:
        return self._ffi.new("llama_pos[]", size)

    def quiet_logs(self) -> None:
        self._lib.harness_quiet_logs()

    def meta(self, model: Any, key: str) -> str | None:
        buf = self._ffi.new("char[]", 256)
        n = int(self._lib.llama_model_meta_val_str(model, key.encode(), buf, 256))
        return self._ffi.string(buf).decode(errors="replace") if n >= 0 else None


# -- the process's driver --------------------------------------------------------------------------------------

_lock = threading.Lock()
_driver: Driver | None = None


def _load_bound(path: Path) -> BoundDriver:
    name = path.name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    if spec is None:
        raise UsageError(f"{DRIVER_ENV}={path} is not a libllama driver")
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as e:
        raise UsageError(f"{DRIVER_ENV}={path} does not load: {e}") from None
    return BoundDriver(module, f"libllama bound from its header ({path.parent.name})")


def _load_package() -> PackageDriver:
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - a broken install
        raise UsageError(
            "llama-cpp-python is not importable; install it with "
            'CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install llama-cpp-python==0.3.36'
        ) from e
    return PackageDriver(llama_cpp, str(getattr(llama_cpp, "__version__", "?")))


def libllama() -> Driver:
    """This process's driver: the bound module ``HARNESS_LIBLLAMA_DRIVER`` names, else llama-cpp-python's."""
    global _driver
    with _lock:
        if _driver is None:
            path = os.environ.get(DRIVER_ENV)
            _driver = _load_bound(Path(path)) if path else _load_package()
        return _driver


def use_driver(path: Path) -> None:
    """Drive libllama through the bound module at ``path`` in this process and every child it starts; refused when
    this process already drives another."""
    if _driver is not None and getattr(_driver, "path", None) != path:
        raise UsageError(f"this process already drives {_driver.name}: start a new one for {path}")
    os.environ[DRIVER_ENV] = str(path)


def libllama_of(tree: Path, *, log: Any = lambda _m: None, flag: str = "--source") -> str:
    """Build ``tree``'s libllama (with its llama-server: one cached build), bind the driver from its own header and
    drive it in this process and its children; one line saying which library runs and how it is driven. A tree
    the harness cannot drive is one :class:`HarnessLimit` line naming the function (exit 6: a skip), said before
    anything is built."""
    src = check_tree(tree, flag)
    try:
        b = binding((src / "include" / "llama.h").read_text(errors="replace"))
    except OSError as e:
        raise UsageError(f"{flag} {src}: no readable include/llama.h: {e}") from None
    if b.refused:
        raise HarnessLimit(refusal(src, b))
    build = server_build(source=src, log=log, flag=flag)
    if build.lib_dir is None:
        raise UsageError(f"the build of {src} has no libllama.so beside {build.binary}")
    use_driver(bind(src, build.lib_dir, log=log))
    batch = "llama_batch and llama_decode" + ("" if b.absent else ", llama_batch_ext and llama_process")
    return (
        f"libllama: {build.lib_dir / 'libllama.so'} (built from {src}), bound from its include/llama.h "
        f"({len(CALLS) - len(b.absent)} functions; batch API: {batch})"
    )
