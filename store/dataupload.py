"""An ImageFolder set sent to the server (POST /v1/datasets, `torchyard data upload`): a
gzip-compressed tar of DIR/train/<class>/<image>… and DIR/val/…, checked member by member
(store/bundlefiles.py: check_archive refuses absolute names, `..`, devices and bombs; here
every link is refused too), unpacked into a staging folder, checked as the trainer reads it
(store/dataimport.py: check_imagefolder) and only then installed where jobs read it: the
server's own data root (TORCHYARD_DATA_ROOT), or the object store every worker pulls from.

The caller's working folder plays no part: the set lands where this server's jobs look.
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from torchyard.settings import Settings
from torchyard.storage import storage_for
from torchyard.storage.datasets import MAX_FILES, dataset_folder, read_manifest
from torchyard.store.bundlefiles import BundleRejected, check_archive
from torchyard.store.dataimport import (
    ImportRefused,
    check_imagefolder,
    imagefolder_name,
    upload_local,
    upload_to_store,
)

STAGING = "datasets"  # the storage's staging prefix for uploads on their way in


class UploadRefused(Exception):
    """The upload cannot be installed: `field` ("name", "body") says which part is wrong;
    `status` 409 for a set already there (without force), 422 otherwise."""

    def __init__(self, field: str, reason: str, status: int = 422) -> None:
        super().__init__(reason)
        self.field, self.reason, self.status = field, reason, status


@dataclass(frozen=True)
class Installed:
    name: str  # imagefolder/<dir>: what a spec names as data.name
    where: str  # the folder in the data root, or the manifest's place in the object store
    files: int
    classes: list[str]


def checked_name(name: str) -> str:
    """`NAME` or `imagefolder/NAME` as the set's full name; UploadRefused("name") when it
    could leave the data root or clash with a built-in set's folder."""
    try:
        return imagefolder_name(name)
    except ImportRefused as e:
        raise UploadRefused("name", str(e).removeprefix("--name ")) from None


def _unpack(archive: Path, tree: Path, max_bytes: int) -> None:
    """Extract only regular files and folders: a link, even one pointing inside, is refused
    (scan_tree would refuse it later anyway; here the message names the member)."""
    try:
        check_archive(archive, max_files=MAX_FILES, max_bytes=max_bytes)
    except BundleRejected as e:
        raise UploadRefused("body", e.reason) from None
    with tarfile.open(archive, "r:gz") as tar:
        members = tar.getmembers()
        for m in members:
            if not (m.isfile() or m.isdir()):
                raise UploadRefused("body", f"{m.name!r}: not a regular file or folder")
        tree.mkdir(mode=0o755)
        tar.extractall(tree, members=members, filter="data")


def install_upload(
    settings: Settings, archive: Path, name: str, *, force: bool = False
) -> Installed:
    """Unpack the uploaded `archive`, check it as an ImageFolder set and install it as
    `imagefolder/<name>` in the server's data root or object store."""
    full = checked_name(name)
    storage = storage_for(settings)
    object_store = not storage.stored_run_dirs
    stage = Path(tempfile.mkdtemp(prefix="upload-", dir=storage.staging_dir(STAGING)))
    try:
        tree = stage / "set"
        _unpack(archive, tree, settings.max_dataset_upload_bytes)
        try:
            classes, _images = check_imagefolder(tree)
        except ImportRefused as e:  # its message names the staging folder: say "archive"
            raise UploadRefused("body", str(e).replace(str(tree), "the archive")) from None
        files = sum(1 for p in tree.rglob("*") if p.is_file())
        if object_store:
            existed = read_manifest(storage, full) is not None
            try:
                published = upload_to_store(storage, tree, full, force=force)
            except ImportRefused as e:
                raise UploadRefused("name", str(e), 409 if existed else 422) from None
            return Installed(full, storage.describe(published.key), files, classes)
        target = settings.data / dataset_folder(full)
        if target.exists() and not force:
            raise UploadRefused("name", f"{full} is on the server already: force replaces it", 409)
        try:
            installed = upload_local(tree, full, settings.data, force=force)
        except ImportRefused as e:
            raise UploadRefused("body", str(e)) from None
        return Installed(full, str(installed), files, classes)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
