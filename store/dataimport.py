"""`torchyard data import NAME FILE…`: put MNIST, Fashion-MNIST or CIFAR-10 into the data root
of a server that cannot download them; `torchyard data upload DIR --name NAME --local` (or
`--data-root DIR`): an ImageFolder set (`imagefolder/NAME`) copied on this host (without
either, torchyard/cli.py sends it to the server's API instead: client/cmd_data.py);
`torchyard data list`, imagefolder sets included.

With an object store (TORCHYARD_STORAGE_URL=s3://…) both publish the set to the store instead
of the local data root (storage/datasets.py: content-addressed blobs, then the manifest), and
every worker host pulls it into its own data root before a job reads it; `--local` writes
into this host's data root all the same.

The files are the official archives, fetched anywhere and copied over: MNIST's and
Fashion-MNIST's four `*-ubyte.gz` files, CIFAR-10's `cifar-10-python.tar.gz`. Each is checked
against torchvision's published MD5 before anything is unpacked (CIFAR-10's members too,
after unpacking), then unpacked in torchvision's layout (`MNIST/raw/train-images-idx3-ubyte`,
…, `cifar-10-batches-py/data_batch_1`, …) into a temporary folder beside the target and
renamed into place: a failed import leaves nothing behind and never half of a data set. Tar
members are taken by name only (the data set's own files), through tarfile's `data` filter
(no absolute names, `..`, links or device files). Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from torchyard.contracts.datasets import missing_dataset_files
from torchyard.contracts.spec import IMAGEFOLDER_RE
from torchyard.settings import get_settings
from torchyard.storage import Storage, storage_for
from torchyard.storage.datasets import (
    BUILTIN_FOLDERS,
    DatasetRejected,
    Published,
    publish_dataset,
    readable_by_all,
    scan_tree,
    stored_datasets,
)

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
# The largest member of the official CIFAR-10 archive is ~31 MB; a bigger one is not it.
MAX_MEMBER_BYTES = 64 << 20
_CHUNK = 1 << 20


@dataclass(frozen=True)
class DataImport:
    """One importable data set: the archives it comes as, with their MD5, and where it goes."""

    name: str
    folder: str  # relative to the data root, as torchvision lays it out
    archives: dict[str, str]  # official file name -> MD5
    members: dict[str, str] = field(default_factory=dict)  # tar: member name -> MD5


# Checksums copied from torchvision 0.29 (torchvision/datasets/mnist.py: MNIST.resources and
# FashionMNIST.resources; torchvision/datasets/cifar.py: CIFAR10.tgz_md5, train_list,
# test_list and meta), so a data root filled here passes torchvision's own integrity checks.
IMPORTS: dict[str, DataImport] = {
    "mnist": DataImport(
        "mnist",
        "MNIST/raw",
        {
            "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
        },
    ),
    "fashion_mnist": DataImport(
        "fashion_mnist",
        "FashionMNIST/raw",
        {
            "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
        },
    ),
    "cifar10": DataImport(
        "cifar10",
        "cifar-10-batches-py",
        {"cifar-10-python.tar.gz": "c58f30108f718f92721af3b95e74349a"},
        {
            "data_batch_1": "c99cafc152244af753f735de768cd75f",
            "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
            "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
            "data_batch_4": "634d18415352ddfa80567beed471001a",
            "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
            "test_batch": "40351d587109b95175f43aff81a1287e",
            "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
        },
    ),
}


# The built-in sets that need nothing in the data root.
NO_FILES = {
    "digits": "it comes with scikit-learn",
    "synthetic": "it is generated from the spec",
}


class ImportRefused(Exception):
    """What the user gave cannot be imported (unknown name, wrong files, bad checksum)."""


def md5_of(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)  # the published checksums are MD5: integrity only
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _spec_for(name: str) -> DataImport:
    if name in NO_FILES:
        raise ImportRefused(f"'{name}' needs no files: {NO_FILES[name]}")
    if name not in IMPORTS:
        raise ImportRefused(f"cannot import '{name}': one of {', '.join(IMPORTS)}")
    return IMPORTS[name]


def find_archives(spec: DataImport, given: list[Path]) -> dict[str, Path]:
    """The official files among `given` (files, or folders holding them), by name; refuses
    other names, repeats and absent ones."""
    found: dict[str, Path] = {}
    for path in given:
        candidates = [path / n for n in spec.archives] if path.is_dir() else [path]
        for p in candidates:
            if path.is_dir() and not p.is_file():
                continue
            if p.name not in spec.archives:
                raise ImportRefused(
                    f"{p}: not one of {spec.name}'s official files ({', '.join(spec.archives)})"
                )
            if p.name in found:
                raise ImportRefused(f"{p.name} is given twice: {found[p.name]} and {p}")
            if not p.is_file():
                raise ImportRefused(f"{p}: no such file")
            found[p.name] = p
    if missing := [n for n in spec.archives if n not in found]:
        raise ImportRefused(f"{spec.name} needs {', '.join(missing)} as well")
    return found


def _check_md5(path: Path, expected: str, what: str) -> None:
    got = md5_of(path)
    if got != expected:
        raise ImportRefused(
            f"{what}: MD5 {got}, but torchvision's published checksum is {expected}: "
            "a damaged or different file (fetch it again)"
        )


def _write_synced(dst: Path, chunks: Iterable[bytes]) -> None:
    with dst.open("wb") as out:
        for chunk in chunks:
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    dst.chmod(0o644)


def _unpack_idx(spec: DataImport, archives: dict[str, Path], stage: Path) -> Path:
    """MNIST-format sets: each `X.gz` becomes `X`, as torchvision extracts them."""
    folder = stage / Path(spec.folder).name
    folder.mkdir(mode=0o755)
    for name, path in archives.items():
        try:
            with gzip.open(path, "rb") as f:
                _write_synced(folder / name.removesuffix(".gz"), iter(lambda: f.read(_CHUNK), b""))
        except (OSError, EOFError) as e:
            raise ImportRefused(f"{path}: not a readable gzip file ({e})") from None
    return folder


def _unpack_tar(spec: DataImport, archives: dict[str, Path], stage: Path) -> Path:
    """CIFAR-10: the set's own members only (not its readme), extracted through tarfile's
    `data` filter (refuses absolute names, `..`, links and devices), each MD5-checked."""
    if not hasattr(tarfile, "data_filter"):
        raise ImportRefused("unpacking an archive safely needs Python 3.11.4 or later")
    (archive,) = archives.values()
    top = Path(spec.folder).name
    wanted = {f"{top}/{m}" for m in spec.members}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.name in wanted]
            for m in members:
                if not m.isfile() or m.size > MAX_MEMBER_BYTES:
                    raise ImportRefused(f"{archive}: {m.name} is not a data file")
            tar.extractall(stage, members=members, filter="data")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ImportRefused(f"{archive}: not a readable tar.gz archive ({e})") from None
    folder = stage / top
    for name, md5 in spec.members.items():
        path = folder / name
        if not path.is_file():
            raise ImportRefused(f"{archive} lacks {top}/{name}")
        _check_md5(path, md5, f"{archive}: {top}/{name}")
        with path.open("rb+") as f:  # on disk before the rename makes it visible
            os.fsync(f.fileno())
        path.chmod(0o644)
    folder.chmod(0o755)
    return folder


def _replace_dir(folder: Path, target: Path, force: bool) -> None:
    """Rename the unpacked `folder` to `target`. An existing target is kept unless `force`:
    then it is moved aside first and removed after, so the target is never half written."""
    if not target.exists():
        folder.rename(target)
        return
    if not force:
        raise ImportRefused(f"{target} already exists: --force replaces it")
    old = folder.parent / "replaced"
    target.rename(old)
    folder.rename(target)
    shutil.rmtree(old)


def _checked_archives(name: str, files: list[Path]) -> tuple[DataImport, dict[str, Path]]:
    spec = _spec_for(name)
    archives = find_archives(spec, files)
    for fname, path in archives.items():
        _check_md5(path, spec.archives[fname], str(path))
    return spec, archives


def import_dataset(name: str, files: list[Path], data_root: Path, force: bool = False) -> Path:
    """Check and unpack one data set's official files into `data_root`; returns its folder."""
    spec, archives = _checked_archives(name, files)
    target = data_root / spec.folder
    if target.exists() and not force:  # before the minutes of unpacking, not after
        raise ImportRefused(f"{target} already exists: --force replaces it")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Unpacked beside the target, on its filesystem, so the final rename is atomic.
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.import-", dir=target.parent))
    try:
        unpack = _unpack_tar if spec.members else _unpack_idx
        unpacked = unpack(spec, archives, stage)
        readable_by_all(unpacked)
        _replace_dir(unpacked, target, force)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return target


def import_to_store(
    storage: Storage, name: str, files: list[Path], force: bool = False
) -> Published:
    """Check and unpack one data set's official files (in a staging folder of the storage),
    then publish them as the data set `name`: its folder as torchvision lays it out."""
    spec, archives = _checked_archives(name, files)
    stage = Path(tempfile.mkdtemp(prefix=f".{name}.import-", dir=storage.staging_dir("datasets")))
    try:
        parent = stage / Path(spec.folder).parent  # MNIST/raw: unpacked into MNIST/
        parent.mkdir(parents=True, exist_ok=True)
        (_unpack_tar if spec.members else _unpack_idx)(spec, archives, parent)
        return publish_dataset(storage, name, stage / spec.folder.split("/")[0], force=force)
    except DatasetRejected as e:
        raise ImportRefused(str(e)) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)


# ---------------------------------------------------------------------------- ImageFolder

# What torchvision's ImageFolder reads (torchvision/datasets/folder.py: IMG_EXTENSIONS).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def imagefolder_name(name: str) -> str:
    """`NAME` (or `imagefolder/NAME`) as the data set's full name, checked."""
    full = name if name.startswith("imagefolder/") else f"imagefolder/{name}"
    if not IMAGEFOLDER_RE.fullmatch(full):
        raise ImportRefused(
            f"--name {name!r}: letters, digits, '_', '.' and '-' (not first), at most 200"
        )
    if full.partition("/")[2] in BUILTIN_FOLDERS:
        raise ImportRefused(f"--name {name!r} is a built-in data set's folder: choose another")
    return full


def _classes(split: Path) -> dict[str, int]:
    """Each class folder of `split` (as ImageFolder finds them) -> its image files."""
    found = {}
    with os.scandir(split) as it:
        for d in sorted((e for e in it if e.is_dir(follow_symlinks=False)), key=lambda e: e.name):
            n = 0
            for _root, _dirs, files in os.walk(d.path):
                n += sum(1 for f in files if f.lower().endswith(IMAGE_SUFFIXES))
            found[d.name] = n
    return found


def check_imagefolder(folder: Path) -> tuple[list[str], int]:
    """`folder` is what the trainer reads as `imagefolder/<dir>` (trainer/data.py: torchvision's
    ImageFolder over `train/` and `val/`): the same class folders in both, each holding
    images. Its class names and image count; ImportRefused naming what is wrong."""
    counts = {}
    for split in ("train", "val"):
        path = folder / split
        if path.is_symlink() or not path.is_dir():
            raise ImportRefused(f"{folder}: no {split}/ folder (it needs train/<class>/<image>…"
                                " and val/<class>/<image>…)")  # fmt: skip
        counts[split] = _classes(path)
        if not counts[split]:
            raise ImportRefused(f"{path}: no class folders")
        if empty := [c for c, n in counts[split].items() if n == 0]:
            raise ImportRefused(
                f"{path}: no images ({', '.join(IMAGE_SUFFIXES)}) in " + ", ".join(empty)
            )
    if list(counts["train"]) != list(counts["val"]):
        raise ImportRefused(
            f"{folder}: train/ has classes {list(counts['train'])}, val/ {list(counts['val'])}"
        )
    return list(counts["train"]), sum(sum(c.values()) for c in counts.values())


def upload_local(folder: Path, name: str, data_root: Path, force: bool = False) -> Path:
    """Copy the ImageFolder set `folder` into `data_root/<dir>` (a staging folder beside it,
    then a rename); links and special files are refused."""
    full = imagefolder_name(name)
    check_imagefolder(folder)
    try:
        files = scan_tree(folder)
    except DatasetRejected as e:
        raise ImportRefused(str(e)) from None
    target = data_root / full.partition("/")[2]
    if target.exists() and not force:
        raise ImportRefused(f"{target} already exists: --force replaces it")
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.upload-", dir=target.parent))
    try:
        tree = stage / target.name
        for rel, path, _size in files:
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, tree / rel, follow_symlinks=False)
        readable_by_all(tree)
        _replace_dir(tree, target, force)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return target


def upload_to_store(storage: Storage, folder: Path, name: str, force: bool = False) -> Published:
    """Publish the ImageFolder set `folder` to the store as `imagefolder/<name>`."""
    full = imagefolder_name(name)
    check_imagefolder(folder)
    try:
        return publish_dataset(storage, full, folder, force=force)
    except DatasetRejected as e:
        raise ImportRefused(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    # Accepted before the action and after it (`data upload DIR --data-root D`): SUPPRESS
    # keeps an action's parser from overwriting what the top-level one parsed.
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument(
        "--data-root", type=Path, default=argparse.SUPPRESS, help="default: TORCHYARD_DATA_ROOT"
    )
    where.add_argument(
        "--local",
        action="store_true",
        default=argparse.SUPPRESS,
        help="write into the data root even when the storage is an object store",
    )
    parser = argparse.ArgumentParser(
        prog="torchyard data",
        parents=[where],
        description="data sets on this host: in its data root (TORCHYARD_DATA_ROOT), or in "
        "the object store (TORCHYARD_STORAGE_URL=s3://…), from which every worker pulls them",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    imp = sub.add_parser(
        "import",
        parents=[where],
        help="check official archives against torchvision's checksums and unpack them",
        description="mnist, fashion_mnist: the four *-ubyte.gz files; "
        "cifar10: cifar-10-python.tar.gz. A folder holding them will do.",
    )
    imp.add_argument("name", metavar="NAME", help=", ".join(IMPORTS))
    imp.add_argument("files", metavar="FILE", nargs="+", type=Path)
    imp.add_argument("--force", action="store_true", help="replace the set if it is there")
    up = sub.add_parser(
        "upload",
        parents=[where],
        help="an ImageFolder set (DIR/train/<class>/<image>…, DIR/val/…) as imagefolder/NAME, "
        "copied on this host (without --local or --data-root it goes to the server's API)",
    )
    up.add_argument("dir", metavar="DIR", type=Path)
    up.add_argument("--name", required=True, help="the set is then data.name imagefolder/NAME")
    up.add_argument("--force", action="store_true", help="replace the set if it is there")
    sub.add_parser(
        "list",
        parents=[where],
        help="which data sets the data root (and the object store) hold",
    )
    return parser


def _object_store(local: bool) -> Storage | None:
    """The configured storage where it is an object store (and `--local` was not given)."""
    if local:
        return None
    storage = storage_for(get_settings())
    return None if storage.stored_run_dirs else storage


def imagefolder_sets(root: Path) -> list[tuple[str, Path]]:
    """The `imagefolder/<dir>` sets in `root`: folders (not a built-in set's, not hidden:
    staging folders are) holding train/ and val/."""
    if not root.is_dir():
        return []
    found = []
    for d in sorted(root.iterdir()):
        if d.name.startswith(".") or d.name in BUILTIN_FOLDERS or d.is_symlink():
            continue
        if all((d / s).is_dir() and not (d / s).is_symlink() for s in ("train", "val")):
            found.append((f"imagefolder/{d.name}", d))
    return found


def _list(root: Path, storage: Storage | None) -> None:
    for name, spec in IMPORTS.items():
        missing = missing_dataset_files(name, root)
        state = "missing " + ", ".join(p.name for p in missing) if missing else "present"
        print(f"{name:<14} {root / spec.folder}: {state}")
    for name, folder in imagefolder_sets(root):
        classes = sum(1 for c in (folder / "train").iterdir() if c.is_dir())
        print(f"{name:<14} {folder}: present ({classes} classes)")
    if storage is None:
        return
    print(f"in the object store ({storage.describe('datasets')}):")
    sets = stored_datasets(storage)
    for m in sets:
        print(f"{m.name:<14} {len(m.files)} files, {m.total_bytes} bytes, created {m.created}")
    if not sets:
        print("(none)")


def _said(p: Published) -> str:
    m = p.manifest
    what = "already in the store, unchanged" if p.unchanged else "stored"
    return (
        f"{what}: {p.key} ({len(m.files)} files, {m.total_bytes} bytes; "
        f"{p.uploaded} uploaded, {p.present} already there); every worker pulls it"
    )


def _run(args: argparse.Namespace, root: Path, storage: Storage | None) -> str:
    """The import or upload asked for; what to print."""
    if args.action == "upload":
        if storage is not None:
            published = upload_to_store(storage, args.dir, args.name, force=args.force)
            return f"{published.manifest.name}: {_said(published)}"
        target = upload_local(args.dir, args.name, root, force=args.force)
        return f"{imagefolder_name(args.name)}: copied into {target}"
    if storage is not None:
        published = import_to_store(storage, args.name, args.files, force=args.force)
        return f"{args.name}: checksums match torchvision's; {_said(published)}"
    target = import_dataset(args.name, args.files, root, force=args.force)
    return f"{args.name}: checksums match torchvision's; unpacked into {target}"


def data_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    given: Path | None = getattr(args, "data_root", None)
    root: Path = (given or get_settings().data).resolve()
    storage: Storage | None = None
    try:
        storage = _object_store(getattr(args, "local", False))
        if args.action == "list":
            _list(root, storage)
            return EXIT_OK
        print(_run(args, root, storage))
    except ImportRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        if storage is not None:
            print(f"error: the object store failed: {e}", file=sys.stderr)
        else:
            print(f"error: cannot write into the data root {root}: {e}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK
