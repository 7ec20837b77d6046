"""`torchyard data upload DIR --name NAME [--force]`, over the API: DIR (train/<class>/<image>…
and val/…) is packed into a gzip-compressed tar in a temporary file and sent to the server
the CLI is configured for (POST /v1/datasets), which checks it and puts it where its jobs
read it. Nothing is written on this machine, wherever the command runs.

`data import`, `data list` and an upload with `--local` or `--data-root DIR` stay the
server's own administration (store/dataimport.py; torchyard/cli.py picks which runs)."""

from __future__ import annotations

import argparse
import os
import stat
import tarfile
import tempfile
from pathlib import Path
from typing import IO, Any

from torchyard.client.cli_common import EXIT_OK, EXIT_USAGE, command_group, err
from torchyard.client.sdk import Client


class NotPackable(Exception):
    """DIR holds something a data set cannot (a link, a special file), or is no folder."""


def add_data_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    action = command_group(
        sub,
        common,
        "data",
        "data sets: upload an ImageFolder set to the server",
        "`data upload` sends the set to the server's API; `data import`, `data list` and "
        "`data upload --local|--data-root DIR` run on the server host itself.",
    )
    sp = action(
        "upload",
        cmd_data_upload,
        "send an ImageFolder set (DIR/train/<class>/<image>…, DIR/val/…) to the server as "
        "imagefolder/NAME (admins)",
    )
    sp.add_argument("dir", metavar="DIR", type=Path)
    sp.add_argument("--name", required=True, help="the set is then data.name imagefolder/NAME")
    sp.add_argument("--force", action="store_true", help="replace the set if it is there")


def _members(folder: Path) -> list[tuple[Path, str]]:
    """(path, name in the archive) of every folder and file under `folder`, sorted; a link
    or special file is refused here, before anything is sent."""
    found: list[tuple[Path, str]] = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in [*dirs, *sorted(files)]:
            path = Path(root, name)
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise NotPackable(f"{path}: a symbolic link (copy the file itself in)")
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise NotPackable(f"{path}: not a regular file")
            found.append((path, path.relative_to(folder).as_posix()))
    return found


def pack_folder(folder: Path, out: IO[bytes]) -> None:
    """Write `folder`'s content as a gzip-compressed tar (names relative to it) to `out`."""
    if folder.is_symlink() or not folder.is_dir():
        raise NotPackable(f"{folder}: not a folder")
    with tarfile.open(fileobj=out, mode="w:gz", compresslevel=1) as tar:  # images: compressed
        for path, name in _members(folder):
            tar.add(path, arcname=name, recursive=False)


def cmd_data_upload(client: Client, args: argparse.Namespace) -> int:
    with tempfile.TemporaryFile() as archive:
        try:
            pack_folder(args.dir, archive)
        except NotPackable as e:
            err(f"DIR {e}")
            return EXIT_USAGE
        archive.seek(0)
        done = client.upload_dataset(args.name, archive, force=args.force)
    print(f"{done['name']}: {done['files']} files, classes {', '.join(done['classes'])}; "
          f"on the server in {done['where']}")  # fmt: skip
    return EXIT_OK
