"""The README stays a two-minute read whose set-up commands are true, and every link in it and in docs/ lands.

The README gives exactly two set-up commands: the main job (install, then ``python -m harness gate``) and the
tests (the Debian packages ``.ci/run`` installs, the install with the test extras, then ``python -m pytest``).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def _setup_commands() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Set-up") :]
    section = section[: section.index("\n## ", 1)]
    return [line[4:] for line in section.splitlines() if line.startswith("    ")]


def test_the_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= 120


def test_the_readme_has_the_two_setup_commands() -> None:
    main_job, tests = _setup_commands()
    flags = 'CMAKE_ARGS="-DGGML_NATIVE=OFF" python -m pip install'
    assert main_job == f"{flags} . && python -m harness gate"
    assert flags + " -e '.[test]' && python -m pytest" in tests and tests.endswith("python -m pytest")
    install = re.search(r"apt-get install -y ([a-z0-9 -]+?) &&", tests)
    assert install and tests.startswith("apt-get update && "), tests
    # every Debian package CI installs for the tests is in the README's command (and ccache, which the builds use)
    ci_packages = set(re.findall(r"apt-get install -y -qq ([a-z0-9-]+)", (ROOT / ".ci" / "run").read_text()))
    assert ci_packages and ci_packages | {"ccache"} <= set(install.group(1).split()), (ci_packages, install.group(1))


def test_every_link_lands() -> None:
    bad = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and dest.suffix == ".md":
                headings = {_slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
                if anchor not in headings:
                    bad.append(f"{page.relative_to(ROOT)}: {target}: no such heading")
    assert not bad, "\n".join(bad)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = README.read_text()
    unlinked = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert not unlinked, unlinked
