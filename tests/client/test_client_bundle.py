"""Packing a code directory: the same tree gives the same bytes (whatever its mtimes, modes
and path), what must stay out stays out, and the result passes the server's own check."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import shutil
import tarfile
from pathlib import Path

import pytest

from torchyard.client.bundle import PackError, bundle_id, pack
from torchyard.store.bundlefiles import check_archive

PACKED = [
    ".torchyardignore",
    "empty",
    "latest.py",
    "run.sh",
    "src",
    "src/data.py",  # a file named like the ignored `data/` directory stays
    "src/model",
    "src/model/__init__.py",
    "src/model/net.py",
    "train.py",
]
FILES = [".torchyardignore", "run.sh", "src/data.py", "src/model/__init__.py"]
FILES += ["src/model/net.py", "train.py"]


def make_tree(root: Path) -> Path:
    for rel, text in {
        "train.py": "from src.model import net\n",
        "run.sh": "#!/bin/sh\npython train.py\n",
        "src/data.py": "ROWS = 10\n",
        "src/model/__init__.py": "",
        "src/model/net.py": "WIDTH = 8\n",
        ".torchyardignore": "# local only\ndata/\n*.ckpt\n",
        ".git/HEAD": "ref: refs/heads/main\n",
        "__pycache__/train.cpython-311.pyc": "",
        "src/model/__pycache__/net.cpython-311.pyc": "",
        "stale.pyc": "",
        ".venv/bin/python": "",
        "data/train.csv": "a,b\n",
        "src/data/raw.bin": "\0",
        "model.ckpt": "weights",
        "src/model/best.ckpt": "weights",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "run.sh").chmod(0o755)
    (root / "empty").mkdir()
    (root / "latest.py").symlink_to("train.py")
    return root


def members(data: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return tar.getmembers()


def test_the_same_tree_packs_to_the_same_bytes(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "a")
    first = pack(tree)
    assert pack(tree) == first
    for path in tree.rglob("*"):
        os.utime(path, (1_700_000_000, 1_700_000_000), follow_symlinks=False)
    (tree / "train.py").chmod(0o600)  # not executable: still 0o644 in the bundle
    assert pack(tree) == first
    copy = shutil.copytree(tree, tmp_path / "elsewhere" / "b", symlinks=True)
    assert pack(copy) == first
    (copy / "src" / "model" / "net.py").write_text("WIDTH = 9\n")
    assert pack(copy) != first
    assert bundle_id(first) == hashlib.sha256(first).hexdigest()


def test_members_are_normalised_and_sorted(tmp_path: Path) -> None:
    data = pack(make_tree(tmp_path))
    assert data[:4] == b"\x1f\x8b\x08\x00"  # gzip, no FNAME flag
    assert data[4:8] == b"\0\0\0\0"  # gzip header mtime
    infos = members(data)
    assert [m.name for m in infos] == PACKED
    for m in infos:
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
    modes = {m.name: m.mode for m in infos}
    assert modes["run.sh"] == modes["src"] == modes["empty"] == 0o755
    assert modes["train.py"] == modes["src/model/net.py"] == 0o644
    link = next(m for m in infos if m.name == "latest.py")
    assert link.issym() and link.linkname == "train.py"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        assert tar.extractfile("src/model/net.py").read() == b"WIDTH = 8\n"


def test_the_packed_bundle_passes_the_servers_check(tmp_path: Path) -> None:
    data = pack(make_tree(tmp_path / "tree"))
    archive = tmp_path / "b.tar.gz"
    archive.write_bytes(data)
    manifest = check_archive(archive, max_files=100, max_bytes=1 << 20)
    assert manifest.names == FILES
    assert manifest.files == len(FILES)
    with gzip.open(archive) as gz:
        gz.read()  # the gzip stream is whole, trailer included


def test_symlinks_out_of_the_tree_are_refused(tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("s")
    for target in ("../../secret.txt", "/etc/passwd", "../a.py/../../secret.txt"):
        tree = tmp_path / "tree"
        shutil.rmtree(tree, ignore_errors=True)
        (tree / "sub").mkdir(parents=True)
        (tree / "a.py").write_text("")
        (tree / "sub" / "evil").symlink_to(target)
        with pytest.raises(
            PackError, match=re.escape(f"'sub/evil': a symlink to '{target}', outside")
        ):
            pack(tree)
    # Through another symlink: lexically inside, really outside.
    shutil.rmtree(tree)
    tree.mkdir()
    (tree / "a.py").write_text("")
    (tree / "d").symlink_to(".")
    (tree / "e").symlink_to("d/../secret.txt")
    with pytest.raises(PackError, match=re.escape("'e': a symlink to 'd/../secret.txt'")):
        pack(tree)


def test_directories_that_cannot_be_packed(tmp_path: Path) -> None:
    with pytest.raises(PackError, match="no such directory"):
        pack(tmp_path / "missing")
    with pytest.raises(PackError, match="no such directory"):
        pack(Path(__file__))
    only_ignored = tmp_path / "ignored"
    (only_ignored / "__pycache__").mkdir(parents=True)
    (only_ignored / "x.pyc").write_text("")
    (only_ignored / "sub").mkdir()
    with pytest.raises(PackError, match="no files to pack"):
        pack(only_ignored)
    for name in ("torchyard", "torchyard.py"):
        tree = tmp_path / name.replace(".", "_")
        (tree / "torchyard").parent.mkdir(parents=True, exist_ok=True)
        (tree / "train.py").write_text("")
        target = tree / name
        target.mkdir() if name == "torchyard" else target.write_text("")
        with pytest.raises(PackError, match=f"'{name}': a reserved top-level name"):
            pack(tree)
    assert isinstance(PackError("x"), ValueError)
