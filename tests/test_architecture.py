"""The house's import rules, read from the code: imports run one way and never in a loop.

Every module of the project is given its floor (see ``harness/__init__.py``); an import of a
module on a higher floor, an import of the project hidden inside a function, or a loop between
modules fails this test with the offending file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("harness", "properties", "faults", "fixtures", "ci")

# the floors, bottom first: a module may import its own floor or below (prefix match, longest first)
FLOORS: list[tuple[str, int]] = [
    ("harness.errors", 0),
    ("harness.findings", 0),
    ("harness.interrupt", 0),  # Ctrl-C: one handler, the live children's process groups
    ("harness.child", 0),
    ("harness.memlimit", 0),  # a real memory limit for a child: cgroup or RLIMIT_AS
    ("fixtures", 0),
    ("harness.model", 1),
    ("harness.trees", 2),  # llama.cpp trees and their builds
    ("harness.targets", 2),
    ("properties", 3),
    ("faults", 4),
    ("harness.trace", 4),  # the libllama call tracer: interposer, replay, shrink
    ("harness.backends", 5),
    ("harness.campaign", 6),  # fuzz campaigns: workers, example databases, live view, replay
    ("harness.report", 6),  # the memory report: saves, flame graphs, the page
    ("harness.bench", 6),  # the bench: its framework, cases, arms and baselines
    ("harness.coverage", 6),  # line and branch coverage of the C++ under test, through gcovr
    ("harness.load", 6),  # concurrent clients and soak against a real server
    ("harness.commands", 7),
    ("harness.cli", 8),
    ("harness.__main__", 8),
    ("harness", 8),  # harness/__init__.py: a docstring only
    ("ci", 9),
    ("harness.pytest_plugin", 9),  # the pytest plugin: on top, nothing imports it
]


def floor(module: str) -> int:
    for prefix, n in sorted(FLOORS, key=lambda p: -len(p[0])):
        if module == prefix or module.startswith(prefix + "."):
            return n
    raise AssertionError(f"module {module} has no floor: add it to FLOORS and to harness/__init__.py")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            if "findings" in p.relative_to(ROOT).parts[:2] and pkg == "fixtures":
                continue  # standalone reproducers: scripts, not part of the house
            mod = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[mod] = p
    return out


def imports(path: Path, mod: str) -> list[tuple[str, int, bool]]:
    """(imported project module, line, inside a function) for every import of the project."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            f = in_func or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
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


def test_imports_run_one_way_and_never_hide_in_functions() -> None:
    bad = []
    for mod, path in modules().items():
        for target, line, in_func in imports(path, mod):
            where = f"{path.relative_to(ROOT)}:{line}"
            if in_func:
                bad.append(f"{where}: {mod} imports {target} inside a function")
            elif floor(target) > floor(mod):
                bad.append(f"{where}: {mod} (floor {floor(mod)}) imports {target} (floor {floor(target)})")
    assert not bad, "\n".join(bad)


def test_no_import_loop_between_modules() -> None:
    mods = modules()
    graph = {m: {t for t, _, _ in imports(p, m) if t in mods and t != m} for m, p in mods.items()}
    # imports of a package's names resolve to the package module itself: close enough for loops
    state: dict[str, int] = {}
    loops: list[str] = []

    def dfs(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                loops.append(" -> ".join([*stack[stack.index(t) :], t]) if t in stack else f"{m} -> {t}")
            elif t not in state:
                dfs(t, [*stack, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m, [m])
    assert not loops, "\n".join(loops)


def test_a_module_that_imports_upward_is_caught() -> None:
    """The check itself can fail: a model module importing a target is on a lower floor."""
    assert floor("harness.model.cache") < floor("harness.targets.libllama")
    assert floor("properties.machine") < floor("faults.sweep") < floor("harness.backends.base")
    assert floor("harness.commands.gate") < floor("harness.cli")


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
