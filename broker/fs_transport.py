"""The embedded broker: kombu's filesystem transport with its races fixed at the cause.

kombu's `filesystem://` transport creates a message file and then writes it, and a
consumer polling the folder may take the file in between: it reads an empty payload and
its `json.loads` kills the whole Celery process (the scheduler crashed this way under
ordinary use), and the message is lost. It also hands a taken file to the system temp
folder with `shutil.move`, a copy when that is another file system, so two consumers could
both read one message.

Here a message is written under a hidden temporary name in the same folder and renamed to
its final name when complete (a rename is atomic), so a consumer only ever sees whole
messages; a consumer takes a file by renaming it into the processed folder (one rename
wins, the losers move on), reads it, and deletes it. A file that still does not parse
(written by an older torchyard, or damaged) is logged and skipped, never fatal: the store
is the truth and every message is a wake-up the scheduler's periodic pass repeats.

`broker/app.py` registers this class for `filesystem://` URLs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from typing import Any

from kombu.transport import filesystem
from kombu.utils.json import dumps, loads

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"  # never matches a queue's "<stamp>_<uuid>.<queue>.msg" pattern
# A producer killed between write and rename leaves its temporary file: removed once older
# than this (no write takes minutes).
STALE_TMP_S = 300.0


class Channel(filesystem.Channel):
    # kombu's own channels disagree on this argument's name (payload / message).
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{round(time.monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        folder = self.data_folder_out
        tmp = os.path.join(folder, f"{TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(dumps(payload).encode())
            os.rename(tmp, os.path.join(folder, name))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise filesystem.ChannelError(f"cannot add a message to {folder!r}: {e}") from e

    def _get(self, queue: str, timeout: float | None = None) -> Any:
        wanted = f"{queue}.msg"
        taken_dir = self.processed_folder
        for filename in sorted(os.listdir(self.data_folder_in)):
            if filename.startswith(TMP_PREFIX):
                self._drop_if_stale(os.path.join(self.data_folder_in, filename))
                continue
            if filename.startswith(".") or filename.partition(".")[2] != wanted:
                continue
            taken = os.path.join(taken_dir, f"{filename}.{uuid.uuid4().hex[:8]}")
            try:
                os.rename(os.path.join(self.data_folder_in, filename), taken)
            except FileNotFoundError:
                continue  # another consumer took it first
            try:
                with open(taken, "rb") as f:
                    payload = f.read()
            finally:
                if not self.store_processed:
                    with contextlib.suppress(OSError):
                        os.unlink(taken)
            try:
                return loads(payload.decode())
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                log.error("embedded broker: skipping unreadable message %s (%s)", filename, e)
        raise filesystem.Empty()

    @staticmethod
    def _drop_if_stale(path: str) -> None:
        with contextlib.suppress(OSError):  # gone already, or another consumer's doing
            if time.time() - os.stat(path).st_mtime > STALE_TMP_S:
                os.unlink(path)

    def get_table(self, exchange: str) -> list[Any]:
        # A binding file is created empty and then written under a lock the reader may
        # beat: an empty read means "being created", so look again before giving up.
        for _ in range(50):
            try:
                return super().get_table(exchange)
            except json.JSONDecodeError:
                time.sleep(0.01)
        return super().get_table(exchange)


class Transport(filesystem.Transport):
    Channel = Channel
