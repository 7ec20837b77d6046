"""A tiny ImageFolder set (train/<class>/<image>, val/<class>/<image>) for the `data upload`
tests: the checks read only the names, so each image is a PNG signature and a few bytes."""

from __future__ import annotations

from pathlib import Path

PNG = b"\x89PNG\r\n\x1a\n" + bytes(16)


def make_imagefolder(folder: Path, classes: tuple[str, ...] = ("cat", "dog")) -> Path:
    """`folder` with one image per class and split; `<split>-<class>.png` holds PNG + class."""
    for split in ("train", "val"):
        for c in classes:
            (folder / split / c).mkdir(parents=True, exist_ok=True)
            (folder / split / c / f"{split}-{c}.png").write_bytes(PNG + c.encode())
    return folder
