"""Every runnable shell and Python block of the tutorials and how-to guides runs, page by page."""

from __future__ import annotations

import pytest

from .runnable import REPO, pages, run_page


def test_some_pages_are_runnable() -> None:
    names = {str(p.relative_to(REPO)) for p in pages()}
    assert "docs/tutorials/pretrain-jsonl.md" in names and len(names) >= 4, names


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO / "docs")))
def test_page_runs(page, tmp_path) -> None:
    run_page(page, tmp_path)
