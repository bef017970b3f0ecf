"""docs/aws.md names every conformance case the aws transport skips, so the page stays the list."""

from __future__ import annotations

from pathlib import Path

from .harness import AWS_SKIPS


def test_the_docs_name_every_conformance_case_the_aws_transport_skips() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "aws.md").read_text(encoding="utf-8")
    section = page[page.index("## Checked only against real AWS"):]
    missing = [case for case in AWS_SKIPS if f"`{case}`" not in section]
    assert missing == []
