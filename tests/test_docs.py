"""The documentation holds together: every ``docs/<page>.md#<anchor>`` that the code, tests and benchmarks cite
names a page and one of its headings; every page is in the site's nav; the README stays short and keeps the two
set-up commands.

The site itself is built by ``mkdocs build --strict`` (``.ci/run``), which checks the links between pages; these tests
need neither MkDocs nor a build. Anchors are computed as MkDocs computes them (Python-Markdown's ``toc`` extension
with its default slug function), by ``slugify`` below.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = REPO / "README.md"

#: Where citations of the design are looked for: the package, the kernels, the tests and the benchmarks.
SOURCE_DIRS = ("cgist", "kernels", "tests", "bench")
SOURCE_SUFFIXES = (".py", ".sh")

#: A citation of one section of a page, e.g. ``docs/design.md#ties``. A trailing dot ends a sentence, not an anchor.
CITATION = re.compile(r"docs/(?P<page>[\w/-]+\.md)#(?P<anchor>[\w.-]*[\w-])")

#: The sections of docs/design.md that code and tests cite; their anchors are a contract, so renaming one fails here.
DESIGN_SECTIONS = {
    "The loss": "the-loss",
    "Rules by release": "rules-by-release",
    "Column groups": "column-groups",
    "Ties": "ties",
    "The streaming algorithm": "the-streaming-algorithm",
    "The kernels": "the-kernels",
    "Numerics": "numerics",
    "Matryoshka": "matryoshka",
    "Statistics": "statistics",
    "The workspace budget": "the-workspace-budget",
    "The drop-in protocol": "the-drop-in-protocol",
    "Dispatch": "dispatch",
    "Adding a score": "adding-a-score",
    "Late interaction": "late-interaction",
    "The guide for late interaction": "the-guide-for-late-interaction",
    "XTR": "xtr",
}

#: The two commands a newcomer runs, exactly as the README's set-up section gives them.
SETUP_COMMANDS = [
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[test]" && cgist train',
    ". .venv/bin/activate && python -m pytest -q -n auto --maxprocesses 4",
]
README_MAX_LINES = 300
#: The one command that builds the site, named in the README.
SITE_COMMAND = 'pip install -e ".[docs]" && mkdocs build --strict'


def slugify(heading: str) -> str:
    """The anchor of a Markdown heading, as Python-Markdown's ``toc`` gives it: the text without markup (a link keeps
    its text), accents folded to ASCII, everything but word characters, spaces and hyphens dropped, lower-cased, and
    each run of spaces and hyphens one hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _lines_outside_code(text: str) -> list[str]:
    """The lines of a Markdown text that are not inside a fenced code block."""
    lines, fence = [], None
    for line in text.splitlines():
        marker = re.match(r"\s*(`{3,}|~{3,})", line)
        if marker:
            if fence is None:
                fence = marker.group(1)[0] * len(marker.group(1))
            elif marker.group(1).startswith(fence):
                fence = None
            continue
        if fence is None:
            lines.append(line)
    return lines


def headings(text: str) -> list[tuple[int, str]]:
    """``(level, text)`` of each ATX heading (``## Title``) outside code blocks."""
    found = []
    for line in _lines_outside_code(text):
        match = re.match(r"(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if match:
            found.append((len(match.group(1)), match.group(2)))
    return found


def anchors(text: str) -> set[str]:
    """Every anchor a page defines: its headings' (a repeated one gets ``_1``, ``_2``, ... as in ``toc``, or its
    ``{#id}``), and the identifiers of the objects mkdocstrings renders from ``::: identifier`` lines."""
    found: set[str] = set()
    for _, heading in headings(text):
        custom = re.search(r"\{\s*#([\w-]+)[^}]*\}\s*$", heading)
        slug = custom.group(1) if custom else slugify(heading)
        unique, n = slug, 0
        while unique in found:
            n += 1
            unique = f"{slug}_{n}"
        found.add(unique)
    for line in _lines_outside_code(text):
        match = re.match(r":::\s+([\w.]+)", line)
        if match:
            found.add(match.group(1))
    return found


def _rendered_objects(text: str) -> list[str]:
    return [m.group(1) for line in _lines_outside_code(text) if (m := re.match(r":::\s+([\w.]+)", line))]


def broken_citations(text: str) -> list[str]:
    """The citations in ``text`` that name no page of docs/ or no anchor of their page (an anchor under an object
    that mkdocstrings renders, such as one of its members, counts as that page's)."""
    broken = []
    for match in CITATION.finditer(text):
        page, anchor = DOCS / match.group("page"), match.group("anchor")
        if not page.is_file():
            broken.append(f"{match.group(0)}: no page docs/{match.group('page')}")
            continue
        content = page.read_text(encoding="utf-8")
        if anchor in anchors(content) or any(anchor.startswith(obj + ".") for obj in _rendered_objects(content)):
            continue
        broken.append(f"{match.group(0)}: docs/{match.group('page')} has no heading with the anchor #{anchor}")
    return broken


def _source_files() -> list[Path]:
    files = [path for folder in SOURCE_DIRS for path in sorted((REPO / folder).rglob("*"))
             if path.suffix in SOURCE_SUFFIXES and path.is_file() and "__pycache__" not in path.parts]
    return [*files, README]


def _nav_pages(node: object) -> list[str]:
    """The page paths of an MkDocs nav (a list of paths, ``{title: path}`` or ``{title: [...]}``), external links
    left out."""
    if isinstance(node, str):
        return [] if "://" in node else [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def _mkdocs_config() -> dict:
    yaml = pytest.importorskip("yaml")

    class Loader(yaml.SafeLoader):
        """Reads mkdocs.yml's Python tags (``!!python/name:...``, ``!ENV``) as plain values instead of failing."""

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    return yaml.load((REPO / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)


def _readme_section(title_start: str) -> str:
    """The README's ``## ...`` section whose title starts with ``title_start``, up to the next ``## ``."""
    text = README.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(title_start)}.*?$(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"README.md has no section '## {title_start}...'"
    return match.group(1)


def _commands(section: str) -> list[str]:
    """The command lines of a section's fenced code blocks: neither blank nor comments."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", section, flags=re.M | re.S)
    return [line.strip() for block in blocks for line in block.splitlines()
            if line.strip() and not line.strip().startswith("#")]


# --- the slug function ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heading, anchor", [*DESIGN_SECTIONS.items(),
                                             ("What \"auto\" takes", "what-auto-takes"),
                                             ("`cgist train`", "cgist-train"),
                                             ("Checkpoints and resuming", "checkpoints-and-resuming"),
                                             ("End to end: the guide sources in `cgist train`",
                                              "end-to-end-the-guide-sources-in-cgist-train"),
                                             ("Directions, partitions and hardness",
                                              "directions-partitions-and-hardness"),
                                             ("A [link](other.md#x) - and  spaces", "a-link-and-spaces"),
                                             ("Numerics: fp32 (tf32x3) & ±1", "numerics-fp32-tf32x3-1")])
def test_slugs_are_those_of_mkdocs(heading, anchor):
    assert slugify(heading) == anchor


def test_repeated_headings_and_rendered_objects_have_anchors():
    page = "# A\n## Notes\n```\n## not a heading\n```\n## Notes\n## Custom {#mine}\n::: cgist.gist_loss\n"
    assert anchors(page) == {"a", "notes", "notes_1", "mine", "cgist.gist_loss"}


def test_a_broken_citation_is_found():
    """The checker is not vacuous: a missing page and a missing anchor are reported, a good citation is not (the
    citations are built so that this file's own text holds none of the bad ones)."""
    prefix = "docs" + "/"
    text = f"see {prefix}design.md#ties. and {prefix}nowhere.md#ties and {prefix}design.md#no-such-section"
    assert broken_citations(text) == [
        f"{prefix}nowhere.md#ties: no page {prefix}nowhere.md",
        f"{prefix}design.md#no-such-section: {prefix}design.md has no heading with the anchor #no-such-section",
    ]


# --- (a) citations ---------------------------------------------------------------------------------------------------


def test_design_has_the_cited_sections():
    """The sections the code cites by anchor, each a ``##`` heading of docs/design.md, in this order."""
    found = [text for level, text in headings((DOCS / "design.md").read_text(encoding="utf-8")) if level == 2]
    assert found == list(DESIGN_SECTIONS)


def test_every_citation_names_a_page_and_one_of_its_headings():
    broken = [f"{path.relative_to(REPO)}: {problem}" for path in _source_files()
              for problem in broken_citations(path.read_text(encoding="utf-8", errors="replace"))]
    assert not broken, "citations of the documentation that lead nowhere:\n" + "\n".join(broken)


# --- (b) the README ------------------------------------------------------------------------------------------------


def test_the_readme_is_short():
    n_lines = len(README.read_text(encoding="utf-8").splitlines())
    assert n_lines <= README_MAX_LINES, f"README.md has {n_lines} lines; at most {README_MAX_LINES} (move detail to docs/)"


def test_the_readme_setup_section_holds_exactly_the_two_commands():
    assert _commands(_readme_section("Set up")) == SETUP_COMMANDS


def test_the_readme_names_the_command_that_builds_the_site():
    assert SITE_COMMAND in README.read_text(encoding="utf-8")
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert "docs" in extras, "the README's site command installs the docs extra, which pyproject.toml must define"


# --- (c) the nav -----------------------------------------------------------------------------------------------------


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    config = _mkdocs_config()
    docs_dir = REPO / config.get("docs_dir", "docs")
    assert docs_dir == DOCS
    nav = _nav_pages(config.get("nav", []))
    pages = sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
    assert pages, "docs/ holds no page"
    assert sorted(set(pages) - set(nav)) == [], "pages of docs/ missing from mkdocs.yml's nav"
    assert sorted(set(nav) - set(pages)) == [], "mkdocs.yml's nav names pages that docs/ does not hold"


def test_the_losses_page_shows_the_options_table():
    """docs/losses.md#cgists-own-options is the options table as ``cgist.losses.options`` renders it."""
    from cgist.losses.options import markdown_table

    assert markdown_table() in (DOCS / "losses.md").read_text(encoding="utf-8")
