"""The llama.cpp tree the reference model is pinned to: the one vendored by ``llama-cpp-python==0.3.36``.

* :func:`sdist_source`: the sdist, fetched with ``pip download`` (no binaries, no deps), extracted safely
  into the harness cache once, its content hash stored beside it; the returned tree is never modified.
* :func:`pinned_files`: the files of the pinned tree as a build stages them, with or without our
  implementation of PR #27451's approach (``fixtures/pr-27451.patch``) laid over it.
* :func:`pinned_tree_hashes` and :func:`pinned_status`: whether a user's tree is the pinned one (with or
  without the patch) and, if not, which of its source files differ.

Everything the harness caches lives under :func:`~harness.trees.tree.cache_root`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from harness.child import run_logged as run_tool
from harness.errors import BuildError, HarnessError, UsageError
from harness.trees.semantics import infer_semantics
from harness.trees.tree import cache_root, file_lock, source_files, tree_hash, walk_tree

__all__ = [
    "PATCH_PATH",
    "PINNED_COMMIT",
    "SDIST_NAME",
    "SDIST_VERSION",
    "apply_patch",
    "export_pinned",
    "log_tail",
    "patched_contents",
    "pinned_files",
    "pinned_semantics",
    "pinned_status",
    "pinned_tree_hashes",
    "sdist_source",
    "source_hash",
]

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
_SDIST_STEM = f"llama_cpp_python-{SDIST_VERSION}"
_VENDOR_SUBDIR = "vendor/llama.cpp"
_SOURCE_MARKER = ".prompt-cache-harness-source.sha256"

PINNED_COMMIT = "0c1e570"
"""The llama.cpp commit vendored by the sdist: the one the reference model mirrors."""
PATCH_PATH = Path(__file__).resolve().parents[2] / "fixtures" / "pr-27451.patch"


def log_tail(path: Path, n: int = 15) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return lines[-n:]


def run_logged(cmd: Sequence[str], log_path: Path, failure: str, cwd: Path | None = None,
               env: Mapping[str, str] | None = None) -> None:  # fmt: skip
    """Run ``cmd`` with its output appended to ``log_path``; a non-zero exit raises ``BuildError(failure)``."""
    with log_path.open("a") as fh:
        fh.write(f"\n$ {shlex.join(cmd)}\n")
        fh.flush()
        try:
            rc = run_tool(cmd, fh, cwd=cwd, env=env)  # its own group: a Ctrl-C stops the compilers too
        except OSError as e:
            raise BuildError(f"{failure}: cannot run {cmd[0]}: {e}") from e
    if rc != 0:
        raise BuildError(f"{failure} (exit {rc}); log: {log_path}")


# --------------------------------------------------------------------------------------------
# the sdist
# --------------------------------------------------------------------------------------------


def _download_sdist(dest: Path, log: Callable[[str], None]) -> Path:
    tarball = dest / f"{_SDIST_STEM}.tar.gz"
    if tarball.is_file():
        return tarball
    dest.mkdir(parents=True, exist_ok=True)
    log(f"fetching {SDIST_NAME}=={SDIST_VERSION} sdist with pip download")
    cmd = [
        # --no-binary names the one package: ":all:" would also build its build dependencies
        # (cmake, ninja, scikit-build-core) from source while pip prepares the metadata, ~1 h on 2 cores
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST_NAME,
        f"{SDIST_NAME}=={SDIST_VERSION}", "-d", str(dest),
    ]  # fmt: skip
    log("$ " + shlex.join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not tarball.is_file():
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise BuildError(f"pip download of {SDIST_NAME}=={SDIST_VERSION} failed (exit {proc.returncode}): {tail}")
    return tarball


def _safe_members(tar: tarfile.TarFile, prefix: str) -> list[tarfile.TarInfo]:
    """The members under ``prefix``, refusing absolute paths, ``..`` and links that leave the tree."""
    out = []
    for m in tar.getmembers():
        name = m.name.removeprefix("./")
        if not (name == prefix.rstrip("/") or name.startswith(prefix)):
            continue
        parts = Path(name).parts
        if name.startswith("/") or ".." in parts:
            raise BuildError(f"unsafe path in sdist: {m.name!r}")
        if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
            continue  # devices, fifos: never in a source tree
        out.append(m)
    return out


def sdist_source(log: Callable[[str], None] = lambda _msg: None) -> Path:
    """The vendored llama.cpp tree of the sdist, downloaded and extracted into the cache if needed.

    The returned directory is never modified; its content hash is stored next to it on extraction.
    """
    root = cache_root() / "sdist"
    extracted = root / _SDIST_STEM
    vendored = extracted / _VENDOR_SUBDIR
    if (extracted / _SOURCE_MARKER).is_file():
        return vendored
    with file_lock(root / ".lock"):
        if (extracted / _SOURCE_MARKER).is_file():
            return vendored
        tarball = _download_sdist(root, log)
        log(f"extracting {tarball.name} ({_VENDOR_SUBDIR})")
        tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=root))
        try:
            try:
                with tarfile.open(tarball, "r:gz") as tar:
                    members = _safe_members(tar, f"{_SDIST_STEM}/{_VENDOR_SUBDIR}/")
                    if not members:
                        raise BuildError(f"{tarball} has no {_VENDOR_SUBDIR}")
                    tar.extractall(tmp, members=members, filter="data")
            except (tarfile.TarError, OSError, EOFError) as e:
                tarball.unlink(missing_ok=True)  # a truncated download: fetch again next time
                raise BuildError(f"cannot extract {tarball}: {e}") from e
            # the sdist marker's hash covers every file, `.git` included (the pinned builds' keys hash it)
            digest = tree_hash(tmp / _SDIST_STEM / _VENDOR_SUBDIR, skip=False)
            (tmp / _SDIST_STEM / _SOURCE_MARKER).write_text(digest + "\n")
            if extracted.exists():
                shutil.rmtree(extracted)  # a half-finished earlier extraction (no marker)
            os.rename(tmp / _SDIST_STEM, extracted)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return vendored


def sdist_extracted() -> Path | None:
    """The vendored tree if the sdist is already extracted (never downloads), else None."""
    extracted = cache_root() / "sdist" / _SDIST_STEM
    return extracted / _VENDOR_SUBDIR if (extracted / _SOURCE_MARKER).is_file() else None


def source_hash(vendored: Path) -> str:
    """The content hash stored when the sdist was extracted."""
    return (vendored.parents[1] / _SOURCE_MARKER).read_text().strip()


# --------------------------------------------------------------------------------------------
# the PR patch
# --------------------------------------------------------------------------------------------


def apply_patch(src: Path, patch_path: Path, log_path: Path) -> None:
    """Apply a unified diff to ``src`` with ``patch``, ``git apply`` or patch-ng (whichever is there)."""
    not_applying = f"patch {patch_path.name} does not apply to the vendored llama.cpp tree"
    if shutil.which("patch"):
        base = ["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "-d", str(src), "-i",
                str(patch_path)]  # fmt: skip
        run_logged([*base[:1], "--dry-run", *base[1:]], log_path, not_applying)
        run_logged(base, log_path, f"applying {patch_path.name} failed")
    elif shutil.which("git"):
        run_logged(["git", "apply", "--check", "-p1", str(patch_path)], log_path, not_applying, cwd=src)
        run_logged(["git", "apply", "-p1", str(patch_path)], log_path, f"applying {patch_path.name} failed", cwd=src)
    else:
        # a fresh host may have neither: patch-ng (a dependency) applies unified diffs in Python
        import patch_ng  # type: ignore[import-untyped]

        pset = patch_ng.fromfile(str(patch_path))
        if not pset:
            raise BuildError(f"{not_applying} (patch-ng cannot parse it)")
        with log_path.open("a") as fh:
            fh.write(f"$ patch_ng.apply(strip=0, root={src})\n")
        if not pset.apply(strip=0, root=str(src)):  # patch-ng strips git's a/ b/ itself
            raise BuildError(f"{not_applying} (patch-ng)")


def _patch_files() -> list[str]:
    try:
        text = PATCH_PATH.read_text()
    except OSError:
        return []
    return re.findall(r"^\+\+\+ b/(\S+)", text, re.M)


def patched_contents(vendored: Path) -> dict[str, bytes | None]:
    """Each file the PR patch touches, as the patch leaves it (None: the patch deletes it)."""
    with tempfile.TemporaryDirectory(prefix=".patched-files-") as tmp:
        root = Path(tmp) / "tree"
        for rel in _patch_files():
            if (vendored / rel).is_file():
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(vendored / rel, root / rel)
        log_path = Path(tmp) / "patch.log"
        try:
            apply_patch(root, PATCH_PATH, log_path)
        except BuildError as e:
            raise BuildError(f"{e} | " + " | ".join(log_tail(log_path, 5))) from None
        return {rel: (root / rel).read_bytes() if (root / rel).is_file() else None for rel in _patch_files()}


def pinned_files(patched: bool, log: Callable[[str], None] = lambda _m: None) -> dict[str, Path | bytes]:
    """The pinned tree's files (relative path -> file, or its content where the patch changed it), as
    :func:`harness.trees.build.build_server` stages them."""
    vendored = sdist_source(log)
    files: dict[str, Path | bytes] = dict(walk_tree(vendored))
    if patched:
        for rel, data in patched_contents(vendored).items():
            if data is None:
                files.pop(rel, None)
            else:
                files[rel] = data
    return files


def export_pinned(patched: bool, dest: Path, log: Callable[[str], None] = lambda _m: None) -> Path:
    """Write the pinned tree (with the PR patch when ``patched``) into ``dest``, a new or empty directory: a
    tree to hand to ``--source``/``--base``, or to start a change from. Its content hashes as the pinned
    tree's, so a build of it is the pinned build."""
    dest = dest.expanduser().resolve()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"--export {dest}: exists and is not an empty directory")
    for rel, item in pinned_files(patched, log).items():
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(item, bytes):
            out.write_bytes(item)
        elif item.is_symlink():
            os.symlink(os.readlink(item), out)
        else:
            shutil.copy2(item, out)
    return dest


def pinned_tree_hashes(log: Callable[[str], None] = lambda _m: None) -> dict[str, str]:
    """:func:`tree_hash` of the pinned tree (``master``) and of it with the PR patch (``shared``), computed once."""
    vendored = sdist_source(log)
    record = vendored.parents[1] / ".pinned-trees.json"
    try:
        patch_sha = hashlib.sha256(PATCH_PATH.read_bytes()).hexdigest()
    except OSError as e:
        raise UsageError(f"cannot read the PR patch {PATCH_PATH}: {e}") from e
    try:
        known = json.loads(record.read_text())
        if known.get("patch_sha256") == patch_sha:
            return {"master": known["master"], "shared": known["shared"]}
    except (OSError, ValueError, KeyError):
        pass
    with tempfile.TemporaryDirectory(prefix=".pinned-", dir=vendored.parents[1]) as tmp:
        patched = Path(tmp) / "src"
        # the sdist keeps the submodule's `.git` file (pointing nowhere): leave it out, as a build does
        shutil.copytree(vendored, patched, symlinks=True,
                        ignore=lambda d, names: [".git"] if d == str(vendored) else [])  # fmt: skip
        for rel, data in patched_contents(vendored).items():
            if data is None:
                (patched / rel).unlink(missing_ok=True)
            else:
                (patched / rel).write_bytes(data)
        hashes = {"master": tree_hash(vendored), "shared": tree_hash(patched)}
    record.write_text(json.dumps({**hashes, "patch_sha256": patch_sha}, indent=2) + "\n")
    return hashes


def pinned_semantics(digest: str) -> str | None:
    """The semantics of the pinned tree with this content (``shared``: with our patch; ``master``: as
    vendored), or None; None too when the pinned tree cannot be had (no sdist, no network)."""
    try:
        hashes = pinned_tree_hashes()
    except HarnessError:
        return None
    return next((sem for sem in ("shared", "master") if hashes[sem] == digest), None)


def pinned_status(
    src: Path, digest: str | None = None, log: Callable[[str], None] = lambda _m: None
) -> tuple[bool, str]:
    """Is ``src`` the tree the model is pinned to (with or without the PR patch), and one line saying
    so or which source files differ from it. Never raises: without the sdist it says so."""
    try:
        hashes = pinned_tree_hashes(log)
        digest = digest or tree_hash(src)
        if digest == hashes["master"]:
            return True, f"the tree is llama.cpp {PINNED_COMMIT}, the commit the model is pinned to"
        if digest == hashes["shared"]:
            return True, f"the tree is llama.cpp {PINNED_COMMIT} + PR #27451, the commit the model is pinned to"
        vendored = sdist_source(log)
        pinned, mine = source_files(vendored), source_files(src)
        with_pr: dict[str, str | None] = {**pinned}
        for rel, data in patched_contents(vendored).items():
            with_pr[rel] = None if data is None else hashlib.sha256(data).hexdigest()
    except (HarnessError, OSError) as e:
        return False, f"cannot compare the tree with llama.cpp {PINNED_COMMIT}: {e}"

    def differing(base: Mapping[str, str | None]) -> list[str]:
        return sorted(k for k in base.keys() | mine.keys() if base.get(k) != mine.get(k))

    # measured against the pinned tree the tree's own semantics start from (with the PR or without)
    base, name = (
        (with_pr, f"{PINNED_COMMIT} + PR #27451")
        if infer_semantics(src).semantics == "shared"
        else (pinned, PINNED_COMMIT)
    )
    diff = differing(base)
    shown = ", ".join(diff[:6]) + (f" and {len(diff) - 6} more" if len(diff) > 6 else "")
    return False, (
        f"the tree differs from llama.cpp {name} (the model is pinned to {PINNED_COMMIT}) in {len(diff)} "
        f"source file{'' if len(diff) == 1 else 's'}: {shown}"
    )
