"""The README's links work where it is the home page (the repository's front page): each relative
link names a file of the repository, and each ``#anchor`` a heading of its target. (The docs site's
own links are checked by ``mkdocs build --strict``.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.MULTILINE)}


def test_every_relative_link_of_the_readme_resolves() -> None:
    readme = ROOT / "README.md"
    text = FENCE.sub("", readme.read_text(encoding="utf-8"))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        page = (readme.parent / path).resolve() if path else readme
        if not page.exists():
            broken.append(f"{target}: no such file")
        elif anchor and page.suffix == ".md" and anchor not in anchors(page):
            broken.append(f"{target}: no heading #{anchor}")
    assert broken == []


def test_the_slug_is_githubs() -> None:
    assert slug("Least-privilege roles") == "least-privilege-roles"
    assert slug("The `workqueue` command") == "the-workqueue-command"
    assert slug("Backlog: what a scaler should see") == "backlog-what-a-scaler-should-see"


def test_no_page_of_the_site_sends_readers_to_a_section_of_the_readme() -> None:
    """The site turns a link to the README into one to its home page (scripts/docs_hooks.py), which
    does not hold the README's sections: a page links to the page of the site that has the text."""
    pointing = [
        f"{page.name}: {target}"
        for page in sorted((ROOT / "docs").glob("*.md"))
        for target in LINK.findall(page.read_text(encoding="utf-8"))
        if target.split("#")[0].endswith("README.md") and (page.parent / target.split("#")[0]).resolve()
        == ROOT / "README.md"
    ]
    assert pointing == []
