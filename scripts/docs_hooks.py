"""MkDocs hooks of the docs site (mkdocs.yml): links from docs/ to files of the repository.

The pages link to files outside docs/ (``../sql/postgresql/roles/scaler_query.sql``,
``../bench/load/last-run.png``) so that they work where the repository is read. In the site such a link
would point nowhere: the file is published with the site under its repository path and the link
is pointed at it. A link to the README points at the site's home page; one to another Markdown file
outside docs/ becomes the file's name in code (it is not a page of the site).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

_LINK = re.compile(r"(!?\[[^\]]*\])\((\.\./[^)\s#]+)(#[^)\s]*)?\)")


def _root(config: Any) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def _targets(config: Any) -> dict[str, Path]:
    """Repository path -> file, of every file outside docs/ a page links to."""
    root, docs = _root(config), Path(config["docs_dir"]).resolve()
    found: dict[str, Path] = {}
    for page in docs.rglob("*.md"):
        for match in _LINK.finditer(page.read_text(encoding="utf-8")):
            target = (page.parent / match.group(2)).resolve()
            if target.is_file() and root in target.parents and docs not in target.parents:
                found[target.relative_to(root).as_posix()] = target
    return found


def on_files(files: Files, config: Any) -> Files:
    for path, target in _targets(config).items():
        if target.suffix != ".md":
            files.append(File.generated(config, path, abs_src_path=str(target)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    root, docs = _root(config), Path(config["docs_dir"]).resolve()
    here = (docs / page.file.src_uri).parent

    def point(match: re.Match[str]) -> str:
        label, link, anchor = match.group(1), match.group(2), match.group(3) or ""
        target = (here / link).resolve()
        if not target.is_file() or docs in target.parents or root not in target.parents:
            return match.group(0)
        path = target.relative_to(root).as_posix()
        if path == "README.md":
            return f"{label}({posixpath.relpath('index.md', posixpath.dirname(page.file.src_uri) or '.')})"
        if target.suffix == ".md":
            return f"{label[1:-1]} (`{path}`)" if not label.startswith("!") else match.group(0)
        relative = posixpath.relpath(path, posixpath.dirname(page.file.src_uri) or ".")
        return f"{label}({relative}{anchor})"

    return _LINK.sub(point, markdown)
