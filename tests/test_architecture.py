"""The house's import rules, read from the code: imports run one way and never in a loop.

Every module of the project is given its floor by the one table, :data:`harness.FLOORS`; an import of a
module on a higher floor, an import of the project hidden inside a function, a loop between modules, or
a target importing another target (:data:`harness.APART`) fails this test with the offending file and
line. ``docs/map.md`` draws the same floors in the same order (checked here too).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from harness import APART, FLOORS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("harness", "properties", "faults", "fixtures", "ci")

# (dotted prefix, floor number), longest prefix first; floor 1 is the ground
_PREFIXES = sorted(((p, n) for n, (_, ps, _) in enumerate(FLOORS, 1) for p in ps), key=lambda x: -len(x[0]))


def floor(module: str) -> int:
    for prefix, n in _PREFIXES:
        # the bare package "harness" is harness/__init__.py only: a new subpackage must be given its floor
        if module == prefix or (module.startswith(prefix + ".") and prefix not in PACKAGES[:1]):
            return n
    raise AssertionError(f"module {module} has no floor: add it to FLOORS in harness/__init__.py and to docs/map.md")


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (root / pkg).rglob("*.py"):
            if "findings" in p.relative_to(root).parts[:2] and pkg == "fixtures":
                continue  # standalone reproducers: scripts, not part of the house
            mod = ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            out[mod] = p
    return out


def imports(path: Path, mod: str) -> list[tuple[str, int, bool]]:
    """(imported project module, line, inside a function) for every import of the project."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            f = in_func or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_func) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = mod.split(".")[: -child.level] if path.name != "__init__.py" else mod.split(".")
                    base = ".".join([*pkg, base]) if base else ".".join(pkg)
                found.append((base, child.lineno, in_func))
            visit(child, f)

    visit(tree, False)
    return [(m, line, f) for m, line, f in found if m.split(".")[0] in PACKAGES]


def _apart(module: str) -> str | None:
    """The package of :data:`harness.APART` whose module ``module`` is (its own name below it), else None."""
    for pkg in APART:
        if module.startswith(pkg + "."):
            return pkg
    return None


def violations(mods: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Every upward import, import hidden in a function and import between modules of an APART package."""
    bad = []
    for mod, path in mods.items():
        for target, line, in_func in imports(path, mod):
            where = f"{path.relative_to(root)}:{line}"
            if in_func:
                bad.append(f"{where}: {mod} imports {target} inside a function")
            elif floor(target) > floor(mod):
                bad.append(f"{where}: {mod} (floor {floor(mod)}) imports {target} (floor {floor(target)})")
            elif (pkg := _apart(mod)) and _apart(target) == pkg and target.split(".")[:3] != mod.split(".")[:3]:
                bad.append(f"{where}: {mod} imports {target}: a module of {pkg} never imports another")
    return bad


def loops(mods: dict[str, Path]) -> list[str]:
    graph = {m: {t for t, _, _ in imports(p, m) if t in mods and t != m} for m, p in mods.items()}
    # imports of a package's names resolve to the package module itself: close enough for loops
    state: dict[str, int] = {}
    found: list[str] = []

    def dfs(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                found.append(" -> ".join([*stack[stack.index(t) :], t]) if t in stack else f"{m} -> {t}")
            elif t not in state:
                dfs(t, [*stack, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m, [m])
    return found


def test_imports_run_one_way_and_never_hide_in_functions() -> None:
    bad = violations(modules())
    assert not bad, "\n".join(bad)


def test_no_import_loop_between_modules() -> None:
    found = loops(modules())
    assert not found, "\n".join(found)


def _house(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    """A synthetic house under ``tmp_path``: ``files`` maps a dotted module to its source."""
    for mod, src in files.items():
        p = tmp_path.joinpath(*mod.split(".")).with_suffix(".py")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src)
    return modules(tmp_path)


def test_a_module_that_imports_upward_is_caught(tmp_path: Path) -> None:
    """The check itself can fail: a model module importing a target, fed to the checker, is one line."""
    mods = _house(tmp_path, {
        "harness.model.cache": "from harness.targets.libllama import load_model\n",
        "harness.targets.libllama": "from harness.model.cache import Tokens\n",
    })  # fmt: skip
    assert violations(mods, tmp_path) == [
        "harness/model/cache.py:1: harness.model.cache (floor 2) imports harness.targets.libllama (floor 4)"
    ]


def test_an_import_hidden_in_a_function_is_caught(tmp_path: Path) -> None:
    """Even a downward import is refused inside a function (or a lambda): every import is at a module's top."""
    mods = _house(tmp_path, {
        "harness.backends.synthetic": "def run():\n    from harness.model.cache import Tokens\n    return Tokens\n",
        "faults.sweep": "f = lambda: __import__('os')\nclass A:\n    def m(self):\n        import properties.run\n",
    })  # fmt: skip
    assert sorted(violations(mods, tmp_path)) == [
        "faults/sweep.py:4: faults.sweep imports properties.run inside a function",
        "harness/backends/synthetic.py:2: harness.backends.synthetic imports harness.model.cache inside a function",
    ]


def test_a_loop_is_caught(tmp_path: Path) -> None:
    """Two modules of one floor importing each other (no floor is crossed) are a loop."""
    mods = _house(tmp_path, {
        "harness.load.a": "from harness.load.b import x\ny = 1\n",
        "harness.load.b": "from harness.load.c import z\nx = 1\n",
        "harness.load.c": "from harness.load.a import y\nz = 1\n",
    })  # fmt: skip
    assert violations(mods, tmp_path) == []
    assert loops(mods) == ["harness.load.a -> harness.load.b -> harness.load.c -> harness.load.a"]


def test_a_target_importing_another_target_is_caught(tmp_path: Path) -> None:
    mods = _house(tmp_path, {
        "harness.targets.llama_server": "from harness.trees.build import build_server\n",
        "harness.targets.lcp_cache": "from harness.targets.libllama import load_model\n",
    })  # fmt: skip
    assert violations(mods, tmp_path) == [
        "harness/targets/lcp_cache.py:1: harness.targets.lcp_cache imports harness.targets.libllama: "
        "a module of harness.targets never imports another"
    ]


def test_every_module_has_a_floor_and_an_unknown_package_has_none() -> None:
    for mod in modules():
        floor(mod)
    with pytest.raises(AssertionError, match=r"harness\.newthing has no floor"):
        floor("harness.newthing")


def _path_of(prefix: str) -> str:
    """How docs/map.md names a package or module: ``harness/trees/``, ``harness/errors.py``, ``fixtures/``."""
    rel = prefix.replace(".", "/")
    if prefix in PACKAGES[:1]:
        return "harness/__init__.py"
    return f"{rel}.py" if (ROOT / f"{rel}.py").is_file() else f"{rel}/"


def test_the_map_draws_the_floors_of_the_table() -> None:
    """docs/map.md has one numbered item per floor of :data:`harness.FLOORS`, in order, naming its packages."""
    text = (ROOT / "docs" / "map.md").read_text()
    items = re.split(r"^(?=\d+\. )", text.split("\n\n", 2)[2], flags=re.M)
    items = [i for i in items if re.match(r"\d+\. ", i)]
    assert [int(i.split(".", 1)[0]) for i in items] == list(range(1, len(FLOORS) + 1)), "map.md's floors"
    missing = [
        f"floor {n} ({name}): {_path_of(p)}"
        for n, ((name, prefixes, _), item) in enumerate(zip(FLOORS, items, strict=True), 1)
        for p in prefixes
        if f"`{_path_of(p)}" not in item
    ]
    assert not missing, "docs/map.md does not name on its floor:\n" + "\n".join(missing)


def test_only_the_child_helper_forks() -> None:
    """Every child process goes through ``harness.child.run_child`` (which always reaps and kills)."""
    bad = []
    for mod, path in modules().items():
        if mod == "harness.child":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("fork", "forkpty", "waitpid"):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: os.{node.attr}: use harness.child.run_child")
    assert not bad, "\n".join(bad)


MODULE_LINES = 500
FUNCTION_LINES = 80


def test_long_modules_and_functions_say_why() -> None:
    """A module over ~500 lines, or with a function over ~80, says why at its top: a ``Size:`` paragraph
    in its docstring, naming each long function."""
    missing = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            src = path.read_text()
            tree = ast.parse(src)
            doc = ast.get_docstring(tree) or ""
            size = doc[doc.find("Size:") :] if "Size:" in doc else ""
            rel = path.relative_to(ROOT).as_posix()
            if src.count("\n") > MODULE_LINES and not size:
                missing.append(f"{rel}: {src.count(chr(10))} lines and no 'Size:' reason in its docstring")
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    n = (node.end_lineno or node.lineno) - node.lineno + 1
                    if n > FUNCTION_LINES and f"``{node.name}``" not in size:
                        missing.append(f"{rel}: {node.name} is {n} lines and the 'Size:' reason does not name it")
    assert not missing, "\n".join(missing)
