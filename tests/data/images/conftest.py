"""Fixtures of the image tests (Pillow makes their JPEGs; without it they are skipped)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("PIL")

from image_trees import make_image_tree  # noqa: E402


@pytest.fixture(scope="package")
def image_tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """The tree of `make_image_tree` (read-only: tests that change it make their own)."""
    root = tmp_path_factory.mktemp("images") / "src"
    return root, make_image_tree(root)
