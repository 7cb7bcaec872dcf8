"""Tiny image trees for the image tests: 32x32 synthetic JPEGs made with Pillow (without it the
tests that import this module are skipped).

Not a conftest.py: a second ``conftest`` module would shadow tests/conftest.py for every test
file that runs after it and imports from ``conftest``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("PIL")

from hpctrain.data.images.synthetic import synthetic_jpeg  # noqa: E402

CLASSES = ("cat", "dog", "eel")
PER_CLASS = 8


def tiny_jpeg(i: int, size: tuple[int, int] = (32, 32)) -> bytes:
    """A small JPEG whose pixels depend on ``i``."""
    return synthetic_jpeg(i, seed=1, size=size, quality=90)


def make_image_tree(root: Path) -> dict[str, bytes]:
    """``root/CLASS/imgNN.jpg`` for 3 classes x 8 images, plus one text file among them;
    returns {relative path: bytes} of the images."""
    images = {}
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for j in range(PER_CLASS):
            rel = f"{name}/img{j:02d}.jpg"
            images[rel] = tiny_jpeg(c * 100 + j)
            (root / rel).write_bytes(images[rel])
    (root / "dog" / "notes.jpg").write_text("not a picture, whatever the name says\n")
    return images


@pytest.fixture(scope="session", name="image_tree")
def image_tree_fixture(tmp_path_factory: pytest.TempPathFactory
                       ) -> tuple[Path, dict[str, bytes]]:
    """The tree of `make_image_tree` (read-only: tests that change it make their own)."""
    root = tmp_path_factory.mktemp("images") / "src"
    return root, make_image_tree(root)
