"""The documentation site's structure, checked without building it (`make docs` builds it).

The strict MkDocs build catches broken links between pages; these tests catch what it
cannot see: a root export missing from the API reference, a README link or a docstring's
reference to a page that is not there, a page left out of the nav, and a getting-started
example that grew past its promise or imports from a submodule.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import velomux_quic

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MKDOCS = ROOT / "mkdocs.yml"
API_ENTRY = re.compile(r"^::: velomux_quic\.(\w+)\s*$", re.MULTILINE)


def nav_pages() -> list[str]:
    """Every page the nav of mkdocs.yml names (``Title: page.md`` or ``- page.md``)."""
    text = MKDOCS.read_text()
    nav = text[text.index("\nnav:") :]
    return re.findall(r"(?::|-)\s+([\w./-]+\.md)\s*$", nav, re.MULTILINE)


def pages_on_disk() -> set[str]:
    return {
        str(path.relative_to(DOCS))
        for path in DOCS.rglob("*.md")
        if not any(part.startswith("_") for part in path.relative_to(DOCS).parts)
    }


def test_the_site_builds_strictly() -> None:
    text = MKDOCS.read_text()
    assert re.search(r"^strict: true$", text, re.MULTILINE), "mkdocs.yml must set strict: true"
    assert re.search(r"^site_dir: site$", text, re.MULTILINE)
    assert "site/" in (ROOT / ".gitignore").read_text().splitlines()
    assert "make docs" in (ROOT / ".ci" / "run").read_text()


def test_every_page_in_the_nav_exists_and_every_page_is_in_the_nav() -> None:
    named = nav_pages()
    assert len(named) == len(set(named)), f"pages named twice in the nav: {named}"
    missing = [page for page in named if not (DOCS / page).is_file()]
    assert not missing, f"the nav of mkdocs.yml names pages that do not exist: {missing}"
    left_out = sorted(pages_on_disk() - set(named))
    assert not left_out, f"pages under docs/ missing from the nav of mkdocs.yml: {left_out}"


def test_the_site_has_the_pages_a_newcomer_and_an_operator_look_for() -> None:
    for page in (
        "getting-started.md",
        "concepts.md",
        "tuning.md",
        "operations.md",
        "security.md",
        "threat-model.md",
        "reliability.md",
        "performance.md",
        "deviations.md",
        "errors.md",
        "api/index.md",
    ):
        assert page in nav_pages(), page


def test_every_root_export_has_exactly_one_api_reference_entry() -> None:
    entries: list[str] = []
    for page in sorted((DOCS / "api").glob("*.md")):
        entries += API_ENTRY.findall(page.read_text())
    exported = {name for name in velomux_quic.__all__ if not name.startswith("__")}
    twice = sorted({name for name in entries if entries.count(name) > 1})
    assert not twice, f"documented more than once in docs/api/: {twice}"
    undocumented = sorted(exported - set(entries))
    assert not undocumented, f"root exports with no `::: velomux_quic.<name>` entry: {undocumented}"
    not_exported = sorted(set(entries) - exported)
    assert not not_exported, f"docs/api/ documents names the root does not export: {not_exported}"


REPOSITORY = "https://github.com/velomux/velomux_quic"


def test_the_readme_links_are_absolute_and_those_into_the_repository_resolve() -> None:
    """The README is the package index's page too, where a relative link breaks."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    relative = [link for link in links if "://" not in link]
    assert not relative, f"README.md has relative links, broken on a package index: {relative}"
    ours = [link for link in links if link.startswith(REPOSITORY + "/")]
    assert any("/docs/" in link for link in ours), "the README links into the docs"
    broken = [
        link
        for link in ours
        if re.match(rf"{REPOSITORY}/(?:blob|tree)/main/", link)
        and not (ROOT / re.sub(rf"{REPOSITORY}/(?:blob|tree)/main/", "", link)).exists()
    ]
    assert not broken, f"README.md links to files the repository does not have: {broken}"
    project = (ROOT / "pyproject.toml").read_text()
    assert f'Homepage = "{REPOSITORY}"' in project


def test_every_page_the_package_source_names_exists() -> None:
    named: dict[str, str] = {}
    package = Path(velomux_quic.__file__).parent  # the installed copy under test-pythons
    for path in package.rglob("*.py"):
        # A path of this tree (not the docs/ of another repository's address).
        for page in re.findall(r"(?<![\w/])docs/[\w/-]+\.(?:md|json)\b", path.read_text()):
            named.setdefault(page, str(path.relative_to(package.parent)))
    # The dashboard is a file of its own, written beside the pages.
    missing = {
        page: source
        for page, source in named.items()
        if not (ROOT / page).exists() and not page.startswith("docs/grafana/")
    }
    assert not missing, f"the package names pages that do not exist: {missing}"


def test_the_getting_started_example_is_short_and_uses_only_the_root() -> None:
    text = (DOCS / "getting-started.md").read_text()
    blocks: list[str] = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    example = next(block for block in blocks if "asyncio.run(" in block)
    code_lines = [line for line in example.splitlines() if line.strip()]
    assert len(code_lines) <= 15, f"the first example is {len(code_lines)} lines, not 15"
    tree = ast.parse(example)
    modules = [
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("velomux_quic")
    ]
    assert modules == ["velomux_quic"], modules


def test_every_link_into_the_repository_names_a_file_it_has() -> None:
    """docs/ links to perf/results/ and examples/ by their repository address (they are
    outside the site); each must exist in this tree."""
    pages = [*DOCS.rglob("*.md"), ROOT / "README.md", *(ROOT / "examples").glob("*.md")]
    pattern = re.compile(rf"{REPOSITORY}/(?:blob|tree)/main/([^)#\s]+)")
    broken = sorted(
        f"{page.relative_to(ROOT)}: {target}"
        for page in pages
        for target in pattern.findall(page.read_text())
        if not (ROOT / target).exists()
    )
    assert not broken, f"links to files the repository does not have: {broken}"


def test_the_headline_figures_are_the_performance_pages_own() -> None:
    """The README and the site's home page quote the figure performance.md gives, not
    another run's."""
    performance = (DOCS / "performance.md").read_text()
    for page in (ROOT / "README.md", DOCS / "index.md"):
        figures = re.findall(r"\d+\.\d+-\d+\.\d+x", page.read_text())
        assert figures, f"{page.name} quotes no ratio"
        missing = [figure for figure in figures if figure not in performance]
        assert not missing, f"{page.name} quotes {missing}, which performance.md does not"


def test_the_quickstart_is_written_once() -> None:
    """The first program lives in getting-started.md; the README and the home page link
    to it instead of repeating it."""
    for page in (ROOT / "README.md", DOCS / "index.md"):
        assert "```python" not in page.read_text(), page.name
        assert "getting-started.md" in page.read_text(), page.name
