"""Bundle archives on disk: every hostile archive refused with a reason naming its member, the
manifest of a good one, and the per-host unpacked cache (reuse, repair, concurrency, and
nothing written outside it). Real gzip tars built with tarfile, no mocks."""

from __future__ import annotations

import io
import tarfile
import threading
from pathlib import Path

import pytest

from torchyard.store import bundlefiles
from torchyard.store.bundlefiles import (
    MARKER,
    BundleRejected,
    Manifest,
    archive_path,
    check_archive,
    sha256_file,
    unpack_cached,
)

LIMITS = {"max_files": 100, "max_bytes": 1 << 20}
Member = tuple[tarfile.TarInfo, bytes]


def file(name: str, data: bytes = b"x", mode: int = 0o644) -> Member:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    return info, data


def entry(name: str, kind: bytes, linkname: str = "", mode: int = 0o644) -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    info.mode = 0o755 if kind == tarfile.DIRTYPE else mode
    return info, b""


def build(path: Path, members: list[Member]) -> Path:
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def good_members() -> list[Member]:
    return [
        entry("./", tarfile.DIRTYPE),
        entry("./pkg", tarfile.DIRTYPE),
        file("./pkg/__init__.py", b""),
        file("./pkg/model.py", b"WIDTH = 3\n"),
        file("./train.py", b"import pkg.model\nprint(pkg.model.WIDTH)\n", 0o755),
        entry("./latest.py", tarfile.SYMTYPE, "train.py"),
        entry("./pkg/up", tarfile.SYMTYPE, "../pkg"),
        entry("./copy.py", tarfile.LNKTYPE, "./train.py", 0o755),  # one inode, one mode
        entry("./empty", tarfile.DIRTYPE),
    ]


HOSTILE: dict[str, tuple[list[Member], str]] = {
    "absolute name": ([file("/etc/evil.py")], "'/etc/evil.py': a path is an absolute path"),
    "dot-dot": ([file("a/../../x")], "'a/../../x': a path is a path outside the bundle"),
    "inner dot-dot": ([file("a/../x")], "'a/../x'"),
    "backslash": ([file("a\\b.py")], "'a\\\\b.py': a path with a NUL or backslash"),
    "empty name": ([file("")], "'': an empty name"),
    "symlink absolute": (
        [entry("passwd", tarfile.SYMTYPE, "/etc/passwd")],
        "'passwd': a symlink to the absolute path '/etc/passwd'",
    ),
    "symlink up": (
        [entry("a", tarfile.DIRTYPE), entry("a/link", tarfile.SYMTYPE, "../../x")],
        "'a/link': a symlink to '../../x', outside the bundle",
    ),
    "symlink via symlink": (
        [entry("d", tarfile.SYMTYPE, "."), entry("e", tarfile.SYMTYPE, "d/../x")],
        "'e': a symlink to 'd/../x', resolving outside the bundle",
    ),
    "write through symlink": (
        [entry("sub", tarfile.DIRTYPE), entry("d", tarfile.SYMTYPE, "sub"), file("d/x.py")],
        "'d/x.py': lies beneath 'd', a symlink",
    ),
    "member beneath a file": ([file("a"), file("a/b")], "'a/b': lies beneath 'a', a file"),
    "hardlink outside": (
        [entry("h", tarfile.LNKTYPE, "../outside.py")],
        "'h': a hardlink target is a path outside the bundle",
    ),
    "hardlink absolute": (
        [entry("h", tarfile.LNKTYPE, "/etc/passwd")],
        "'h': a hardlink to the absolute path '/etc/passwd'",
    ),
    "hardlink to nothing": (
        [entry("h", tarfile.LNKTYPE, "later.py"), file("later.py")],
        "'h': a hardlink to 'later.py', not a regular file before it",
    ),
    "char device": ([entry("tty", tarfile.CHRTYPE)], "'tty': a character device, not a"),
    "block device": ([entry("sda", tarfile.BLKTYPE)], "'sda': a block device"),
    "fifo": ([entry("pipe", tarfile.FIFOTYPE)], "'pipe': a FIFO"),
    "contiguous": ([entry("c", tarfile.CONTTYPE)], "'c': a contiguous file"),
    "too many files": (
        [file(f"f{i:02}.py") for i in range(101)],
        "'f100.py': more than 100 entries in the bundle",
    ),
    "too many bytes": (
        [file("a.bin", b"a" * 600_000), file("b.bin", b"b" * 600_000)],
        "'b.bin': the bundle unpacks to more than 1048576 bytes",
    ),
    "shadowing package": (
        [entry("torchyard", tarfile.DIRTYPE), file("torchyard/__init__.py")],
        "'torchyard': shadows torchyard's own package",
    ),
    "shadowing module": ([file("./torchyard.py")], "'./torchyard.py': shadows torchyard"),
    "shadowing extension": ([file("torchyard.abi3.so")], "'torchyard.abi3.so': shadows"),
    "marker name": ([file(MARKER)], f"'{MARKER}': a name reserved"),
    "duplicate file": ([file("a.py"), file("./a.py")], "'./a.py': appears twice"),
    "file over dir": ([entry("a", tarfile.DIRTYPE), file("a")], "'a': appears twice"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_archives_are_refused_naming_the_member(tmp_path: Path, case: str) -> None:
    members, reason = HOSTILE[case]
    archive = build(tmp_path / "b.tar.gz", members)
    with pytest.raises(BundleRejected) as caught:
        check_archive(archive, **LIMITS)
    assert f"member {reason}" in caught.value.reason, caught.value.reason
    assert caught.value.status == 422


def test_the_brief_limits_stop_at_the_first_member_over_them(tmp_path: Path) -> None:
    many = build(tmp_path / "many.tar.gz", [file(f"f{i:02}") for i in range(11)])
    with pytest.raises(BundleRejected, match="member 'f10': more than 10 entries"):
        check_archive(many, max_files=10, max_bytes=1 << 20)
    big = build(tmp_path / "big.tar.gz", [file("a", b"a" * 600), file("b", b"b" * 600)])
    with pytest.raises(BundleRejected, match="member 'b': the bundle unpacks to more than 1000"):
        check_archive(big, max_files=10, max_bytes=1000)


def test_a_sparse_member_is_refused(tmp_path: Path) -> None:
    info, _ = entry("holes.bin", tarfile.GNUTYPE_SPARSE)
    archive = tmp_path / "s.tar.gz"
    with tarfile.open(archive, "w:gz", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(info)
    with pytest.raises(BundleRejected, match=r"member 'holes\.bin': a sparse file"):
        check_archive(archive, **LIMITS)


def test_a_gzip_bomb_in_a_header_is_bounded(tmp_path: Path) -> None:
    """tarfile reads pax records whole into memory: a header over the limit is refused
    before tarfile reads it (test_hostile_bundles.py measures the memory)."""
    info, data = file("a.py")
    info.pax_headers = {"comment": "x" * 8_000_000}
    archive = build(tmp_path / "bomb.tar.gz", [(info, data)])
    assert archive.stat().st_size < 100_000
    with pytest.raises(BundleRejected, match=r"an extended \(pax\) header of 8000\d+ bytes"):
        check_archive(archive, max_files=2, max_bytes=1000)


def test_not_a_gzip_tar_and_truncated_archives_are_refused(tmp_path: Path) -> None:
    good = build(tmp_path / "good.tar.gz", good_members()).read_bytes()
    plain = io.BytesIO()
    with tarfile.open(fileobj=plain, mode="w") as tar:
        info, data = file("a.py")
        tar.addfile(info, io.BytesIO(data))
    cases = {
        "text": b"print('hello')\n",
        "empty": b"",
        "plain tar": plain.getvalue(),
        "truncated": good[: len(good) // 2],
        "no trailer": good[:-4],
        "corrupt": good[:30] + bytes(b ^ 0xFF for b in good[30:60]) + good[60:],
    }
    for label, data in cases.items():
        path = tmp_path / f"{label}.tar.gz"
        path.write_bytes(data)
        with pytest.raises(BundleRejected, match="not a valid gzip-compressed tar") as caught:
            check_archive(path, **LIMITS)
        assert caught.value.status == 422, label


def test_a_good_archive_gives_its_manifest(tmp_path: Path) -> None:
    archive = build(tmp_path / "good.tar.gz", good_members())
    manifest = check_archive(archive, **LIMITS)
    assert manifest == Manifest(
        files=4,
        bytes=len(b"WIDTH = 3\n") + len(b"import pkg.model\nprint(pkg.model.WIDTH)\n"),
        names=["copy.py", "pkg/__init__.py", "pkg/model.py", "train.py"],
    )


def test_archive_path_and_ids(tmp_path: Path) -> None:
    bid = "ab" * 32
    assert archive_path(tmp_path, bid) == tmp_path / "bundles" / f"{bid}.tar.gz"
    for bad in ("AB" * 32, "ab" * 31, "../" + "a" * 61, "g" * 64, ""):
        with pytest.raises(ValueError, match="not a bundle id"):
            archive_path(tmp_path, bad)
        with pytest.raises(ValueError, match="not a bundle id"):
            unpack_cached(tmp_path / "x", bad, tmp_path / "cache", **LIMITS)


# ---------------------------------------------------------------- unpack_cached


def stored(storage: Path, members: list[Member]) -> tuple[Path, str]:
    """An archive under `storage` as the API keeps it: named by its sha256."""
    tmp = build(storage / "upload.tar.gz", members)
    bid = sha256_file(tmp)
    path = archive_path(storage, bid)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(path)
    return path, bid


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    """storage, the cache root and a sibling of the cache root that must stay empty."""
    made = {name: tmp_path / name for name in ("storage", "cache", "outside")}
    for path in made.values():
        path.mkdir()
    return made


def test_unpack_extracts_once_and_reuses_the_tree(dirs: dict[str, Path]) -> None:
    archive, bid = stored(dirs["storage"], good_members())
    tree = unpack_cached(archive, bid, dirs["cache"], **LIMITS)
    assert tree == dirs["cache"] / bid
    assert (tree / "pkg" / "model.py").read_text() == "WIDTH = 3\n"
    assert (tree / "latest.py").readlink() == Path("train.py")
    assert (tree / "copy.py").read_bytes() == (tree / "train.py").read_bytes()
    assert (tree / "train.py").stat().st_mode & 0o100
    assert (tree / "empty").is_dir()
    marker = (tree / MARKER).stat()
    # Python's own additions do not spoil the cache.
    (tree / "pkg" / "__pycache__").mkdir()
    (tree / "pkg" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    (tree / "stray.pyc").write_bytes(b"\0")
    assert unpack_cached(archive, bid, dirs["cache"], **LIMITS) == tree
    again = (tree / MARKER).stat()
    assert (again.st_ino, again.st_mtime_ns) == (marker.st_ino, marker.st_mtime_ns)
    assert sorted(p.name for p in dirs["cache"].iterdir()) == [f".lock-{bid}", bid]


def spoil_modify(tree: Path) -> None:
    (tree / "pkg" / "model.py").write_text("WIDTH = 4\n")  # same size, other content


def spoil_remove(tree: Path) -> None:
    (tree / "empty").rmdir()


def spoil_marker(tree: Path) -> None:
    (tree / MARKER).write_text("{not json")


@pytest.mark.parametrize("spoil", [spoil_modify, spoil_remove, spoil_marker])
def test_a_spoilt_tree_is_unpacked_afresh(
    dirs: dict[str, Path], spoil, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive, bid = stored(dirs["storage"], good_members())
    tree = unpack_cached(archive, bid, dirs["cache"], **LIMITS)
    first = (tree / MARKER).stat().st_ino
    spoil(tree)
    assert unpack_cached(archive, bid, dirs["cache"], **LIMITS) == tree
    assert (tree / MARKER).stat().st_ino != first
    assert (tree / "pkg" / "model.py").read_text() == "WIDTH = 3\n"
    assert (tree / "empty").is_dir()
    # The spoilt tree is renamed away, not deleted: a job may still run from it ...
    (old,) = dirs["cache"].glob(f".old-{bid}-*")
    assert sorted(p.name for p in dirs["cache"].iterdir()) == [f".lock-{bid}", old.name, bid]
    # ... until it is older than a day, when the next unpacking sweeps it.
    monkeypatch.setattr(bundlefiles, "OLD_TREES_KEEP_S", -1.0)
    spoil_modify(tree)
    assert unpack_cached(archive, bid, dirs["cache"], **LIMITS) == tree
    assert not old.exists() and len(list(dirs["cache"].glob(f".old-{bid}-*"))) == 1


def test_what_a_job_adds_beside_the_bundle_keeps_the_tree(dirs: dict[str, Path]) -> None:
    """A job's cwd is the tree: its outputs there do not change the bundle's modules."""
    archive, bid = stored(dirs["storage"], good_members())
    tree = unpack_cached(archive, bid, dirs["cache"], **LIMITS)
    first = (tree / MARKER).stat().st_ino
    (tree / "pkg" / "extra.py").write_text("")
    (tree / "outputs").mkdir()
    assert unpack_cached(archive, bid, dirs["cache"], **LIMITS) == tree
    assert (tree / MARKER).stat().st_ino == first and (tree / "pkg" / "extra.py").exists()


def test_an_archive_that_does_not_match_its_id_is_refused(dirs: dict[str, Path]) -> None:
    archive, _ = stored(dirs["storage"], good_members())
    other = "0" * 64
    with pytest.raises(BundleRejected, match="archive content does not match its id"):
        unpack_cached(archive, other, dirs["cache"], **LIMITS)
    assert not (dirs["cache"] / other).exists()


ESCAPES: list[list[Member]] = [
    [file("../../outside/evil.py")],
    [entry("out", tarfile.SYMTYPE, "../../outside"), file("out/evil.py")],
    [entry("d", tarfile.SYMTYPE, "."), entry("out", tarfile.SYMTYPE, "d/../../outside")],
    [entry("h", tarfile.LNKTYPE, "../../outside/evil.py")],
]


@pytest.mark.parametrize("members", ESCAPES)
def test_nothing_is_written_outside_the_cache(dirs: dict[str, Path], members) -> None:
    archive, bid = stored(dirs["storage"], members)
    with pytest.raises(BundleRejected, match="member "):
        unpack_cached(archive, bid, dirs["cache"], **LIMITS)
    assert not (dirs["cache"] / bid).exists()
    assert [p.name for p in dirs["cache"].iterdir()] == [f".lock-{bid}"]
    good, good_id = stored(dirs["storage"], good_members())
    unpack_cached(good, good_id, dirs["cache"], **LIMITS)
    assert list(dirs["outside"].iterdir()) == []


def test_concurrent_callers_both_get_a_complete_tree(dirs: dict[str, Path]) -> None:
    members = good_members() + [file(f"data/{i:03}.txt", b"%d" % i) for i in range(50)]
    archive, bid = stored(dirs["storage"], members)
    start = threading.Barrier(4)
    results: list[Path] = []
    errors: list[BaseException] = []

    def call() -> None:
        start.wait()
        try:
            tree = unpack_cached(archive, bid, dirs["cache"], **LIMITS)
            assert (tree / MARKER).is_file()
            assert len(list((tree / "data").iterdir())) == 50
            results.append(tree)
        except BaseException as e:  # surfaced below, in the test's own thread
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [dirs["cache"] / bid] * 4
    assert sorted(p.name for p in dirs["cache"].iterdir()) == [f".lock-{bid}", bid]
