"""storage/beneath.py: file operations under a folder a job can write, by descriptor, no
link followed at any part (with openat2 and with the part-by-part walk)."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchyard.storage import beneath
from torchyard.storage.keys import UnsafePath


@pytest.fixture(params=["openat2", "walk"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "walk":
        monkeypatch.setattr(beneath, "_openat2_works", False)
    yield request.param


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "a.pt").write_bytes(b"weights")
    (tmp_path / "secret").write_bytes(b"root only")
    return run


def test_a_link_at_any_part_is_refused(tree: Path, mode: str) -> None:
    secret = tree.parent / "secret"
    (tree / "last.pt").symlink_to(secret)
    (tree / "via").symlink_to(tree / "checkpoints")
    for rel in ("last.pt", "via/a.pt"):
        with pytest.raises(UnsafePath):
            beneath.read_file(tree, rel, 100)
        with pytest.raises(PermissionError):
            beneath.append_owned(tree, rel, b"x")
    with pytest.raises(UnsafePath):
        beneath.copy_out(tree, "via/a.pt", tree.parent / "out")
    assert secret.read_bytes() == b"root only"
    assert beneath.read_file(tree, "checkpoints/a.pt", 100) == b"weights"
    with pytest.raises(UnsafePath):
        beneath.read_file(tree, "../secret", 100)


def test_a_fifo_or_a_folder_is_not_a_file_and_never_blocks(tree: Path, mode: str) -> None:
    os.mkfifo(tree / "events.jsonl")
    with pytest.raises(FileNotFoundError):
        beneath.hash_file(tree, "events.jsonl")
    with pytest.raises(FileNotFoundError):
        beneath.open_file(tree, "checkpoints")


def test_copy_out_hashes_what_it_copied_and_never_overwrites(tree: Path, mode: str) -> None:
    dest = tree.parent / "copy"
    sha, n = beneath.copy_out(tree, "checkpoints/a.pt", dest)
    assert (sha, n) == (hashlib.sha256(b"weights").hexdigest(), 7)
    assert dest.read_bytes() == b"weights"
    with pytest.raises(FileExistsError):  # a name planted first is never written through
        beneath.copy_out(tree, "checkpoints/a.pt", dest)


def test_append_owned_refuses_a_file_of_another_user(tree: Path) -> None:
    log = tree / "output.log"
    beneath.append_owned(tree, "output.log", b"one\n")
    beneath.append_owned(tree, "output.log", b"two\n")
    assert log.read_bytes() == b"one\ntwo\n"
    if os.geteuid() == 0:
        os.chown(log, 64123, 64123)
        with pytest.raises(PermissionError):
            beneath.append_owned(tree, "output.log", b"three\n")
    else:
        assert os.stat(log).st_uid == os.geteuid()


def test_claim_owned_keeps_the_bytes_of_a_foreign_log_and_moves_a_link_aside(tree: Path) -> None:
    log = tree / "output.log"
    log.write_bytes(b"earlier attempts\n")
    if os.geteuid() == 0:
        os.chown(log, 64123, 64123)
    beneath.claim_owned(tree, "output.log")
    st = os.stat(log)
    assert (st.st_uid, log.read_bytes()) == (os.geteuid(), b"earlier attempts\n")
    log.unlink()
    log.symlink_to(tree.parent / "secret")
    beneath.claim_owned(tree, "output.log")
    assert not log.exists() and not log.is_symlink()
    assert (tree.parent / "secret").read_bytes() == b"root only"


def test_replace_file_never_writes_through_a_planted_name(tree: Path, mode: str) -> None:
    secret = tree.parent / "secret"
    (tree / "spec.json").symlink_to(secret)
    beneath.replace_file(tree, "spec.json", b"{}")
    assert (tree / "spec.json").read_bytes() == b"{}"
    assert not (tree / "spec.json").is_symlink()
    assert secret.read_bytes() == b"root only"
    assert [p.name for p in tree.iterdir() if p.name.endswith(".tmp")] == []


def test_link_tree_links_files_and_links_as_themselves(tree: Path, tmp_path: Path) -> None:
    (tree / "out").symlink_to(tmp_path)  # a folder link: linked as a link, never entered
    dst = tmp_path / "dst"
    dst.mkdir()
    beneath.link_tree(tree, dst, limit=100)
    assert (
        os.stat(dst / "checkpoints" / "a.pt").st_ino
        == os.stat(tree / "checkpoints" / "a.pt").st_ino
    )
    assert (dst / "out").is_symlink()
    assert sorted(p.name for p in dst.iterdir()) == ["checkpoints", "out"]
    with pytest.raises(OSError, match="over 1 files"):
        other = tmp_path / "other"
        other.mkdir()
        beneath.link_tree(tree, other, limit=1)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_chown_tree_keeps_the_named_files_and_never_follows_a_link(tree: Path) -> None:
    secret = tree.parent / "secret"
    (tree / "output.log").write_text("")
    (tree / "out").symlink_to(secret)
    beneath.chown_tree(tree, 64123, 64124, keep=lambda name: name == "output.log")
    assert os.stat(tree / "checkpoints" / "a.pt").st_uid == 64123
    assert os.lstat(tree / "out").st_uid == 64123
    assert os.stat(secret).st_uid == 0 and os.stat(tree / "output.log").st_uid == 0


def test_remove_and_empty_dir_unlink_links_never_their_targets(tree: Path) -> None:
    secret_dir = tree.parent / "keep"
    secret_dir.mkdir()
    (secret_dir / "f").write_text("x")
    (tree / "checkpoints" / "d").symlink_to(secret_dir)
    assert beneath.remove(tree, "checkpoints")
    assert not beneath.remove(tree, "checkpoints")
    (tree / "l").symlink_to(secret_dir)
    beneath.empty_dir(tree)
    assert list(tree.iterdir()) == [] and (secret_dir / "f").exists()


def test_copy_tree_keeps_modes_and_links(tmp_path: Path) -> None:
    src = tmp_path / "bundle"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "run.sh").write_text("#!/bin/sh\n")
    (src / "pkg" / "run.sh").chmod(0o755)
    (src / "alias").symlink_to("pkg/run.sh")
    dst = tmp_path / "code"
    dst.mkdir()
    beneath.copy_tree(src, dst)
    assert stat.S_IMODE(os.stat(dst / "pkg" / "run.sh").st_mode) == 0o755
    assert os.readlink(dst / "alias") == "pkg/run.sh"
