"""bench/ keeps one folder per benchmark, its results out of git (.gitignore: ``bench/**/results/``)
but for each benchmark's last quoted run, and every bench path a document names exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("compare", "jobs", "load", "dashboard", "experiments")
DOCUMENTS = ("README.md", "CHANGELOG.md", "bench/README.md", "bench/compare/peers/README.md", "docs/*.md")
# A bench path as the documents write it; one after ``git show C:`` is the path at commit C.
BENCH_PATH = re.compile(r"(?<![:\w/.-])bench/[\w./-]*\w")


def test_every_tracked_bench_file_is_in_a_benchmarks_folder_and_no_result_is_tracked() -> None:
    tracked = subprocess.run(["git", "ls-files", "bench"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = tracked.stdout.split()
    assert "bench/README.md" in files
    astray = [f for f in files if f != "bench/README.md" and f.split("/")[1] not in FOLDERS]
    results = [f for f in files if "/results/" in f]
    assert not astray and not results, f"outside {FOLDERS}: {astray}; results tracked: {results}"
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *(f"bench/{f}/results/x.json" for f in FOLDERS)],
                             cwd=ROOT, capture_output=True, text=True)
    assert len(ignored.stdout.split()) == len(FOLDERS), "bench/<folder>/results/ must be ignored (.gitignore)"


def test_every_bench_path_the_documents_name_exists() -> None:
    missing: list[str] = []
    for pattern in DOCUMENTS:
        for document in sorted(ROOT.glob(pattern)):
            for match in BENCH_PATH.finditer(document.read_text(encoding="utf-8")):
                path = match.group(0)
                if "/results" not in path and not (ROOT / path).exists():  # results/: a run's output
                    missing.append(f"{document.relative_to(ROOT)}: {path}")
    assert not missing, missing
