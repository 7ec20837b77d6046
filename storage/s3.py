"""The object-storage backend (`s3://bucket/prefix`): any S3-compatible store (AWS,
SeaweedFS, MinIO, Ceph, R2…) through one shared boto3 client (clients are thread-safe),
made on first use (no network I/O when the backend is built), at TORCHYARD_S3_ENDPOINT_URL
(path-style) or AWS's own, credentials from boto3's usual chain.

Layout: the object of key K is `<prefix>/K` (`K` with no prefix), its user metadata
`sha256` the hash of its bytes (every write sets it; `stat` reports it). An appended
object (a log, events) is pieces `<prefix>/K.pieces/<start>-<end>` (storage/pieces.py).
`check()` writes its probe under `<prefix>/.torchyard-probe/`; `list` never shows either.

Transfers are this module's own: a file larger than TORCHYARD_S3_PART_BYTES goes up as a
multipart upload, TORCHYARD_S3_CONCURRENCY parts at a time (no more parts in memory), each
with its Content-MD5 (the store checks every part) and retried on transient errors, the
sha256 computed in one pass as the parts are read, and the upload aborted (no object, no
parts left) on a mismatch or a failure. `write_stream` of more than one part spools to a
file in the cache first, so its sha256 is known when the upload starts. `local_copy`
downloads in concurrent ranged GETs into a temporary file beside its place in the cache,
checks the sha256, then renames it in.

On this host: the storage root (TORCHYARD_STORAGE_ROOT) is a cache with the local
backend's layout: `run_dir(job)` is `<root>/jobs/<job>`, a fetched object lands at
`<root>/<key>`, and no link there is followed (a sandboxed trainer writes its run dir).

Errors: no object is FileNotFoundError; refused credentials PermissionError; the store out
of reach (connection, timeout, 5xx or throttling after botocore's retries)
StorageUnavailable, which callers treat as transient.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, BinaryIO, TypeVar, cast
from urllib.parse import urlparse

import boto3  # type: ignore[import-untyped]
from botocore.config import Config  # type: ignore[import-untyped]
from botocore.exceptions import (  # type: ignore[import-untyped]
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    PartialCredentialsError,
)

from torchyard.settings import Settings
from torchyard.storage.base import (
    COPY_BLOCK,
    ChecksumMismatch,
    ObjectInfo,
    Storage,
    StorageConfigError,
    StorageUnavailable,
    sha256_file,
)
from torchyard.storage.keys import UnsafePath, check_key, job_prefix
from torchyard.storage.local import LocalStorage
from torchyard.storage.pieces import (
    PIECES,
    Listed,
    Piece,
    PieceLog,
    chain,
    piece_name,
    split_piece,
)

__all__ = ["PROBE", "S3Storage"]

PROBE = ".torchyard-probe"  # the folder under the prefix `check()` writes its probe into
MAX_PARTS = 10_000  # S3's limit on the parts of one upload
TRIES = 4  # attempts of one part or range (each after botocore's own retries)
BACKOFF_S = 0.5
TAIL_READ = 16 << 20  # bytes one tail read returns at most
HASH_BLOCK = 8 << 20  # bytes hashed at a time while a multipart upload goes up
_T = TypeVar("_T")
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_REFUSED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"}
_BUSY = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError"}
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")  # what a presigned download is saved as


class _PastEnd(Exception):
    """A range that starts at or past the object's end (416)."""


def _status(e: ClientError) -> tuple[str, int]:
    err = e.response.get("Error", {})
    status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return str(err.get("Code", status)), status


class S3Storage(Storage):
    """Objects in `bucket` under `prefix`; `cache` is this host's storage root."""

    scheme = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        cache: Path,
        endpoint_url: str | None = None,
        part_bytes: int = 64 << 20,
        concurrency: int = 8,
    ) -> None:
        self.bucket, self.prefix = bucket, check_key(prefix, allow_empty=True)
        self.root = f"{self.prefix}/" if self.prefix else ""
        self.endpoint_url = endpoint_url
        self.part_bytes, self.concurrency = part_bytes, concurrency
        self.cache = LocalStorage(cache)  # the cache's file operations: no link followed
        self.log = PieceLog(self)
        self._client_obj: Any = None
        self._client_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, settings: Settings) -> S3Storage:
        """`s3://bucket/prefix` with the settings' endpoint, part size and concurrency."""
        parsed = urlparse(url)
        if not parsed.netloc:
            raise StorageConfigError(f"TORCHYARD_STORAGE_URL {url!r} names no bucket")
        return cls(
            parsed.netloc,
            parsed.path.strip("/"),
            cache=settings.storage,
            endpoint_url=settings.s3_endpoint_url,
            part_bytes=settings.s3_part_bytes,
            concurrency=settings.s3_concurrency,
        )

    # ---------------------------------------------------------------- the client

    def _make_client(self, *, quick: bool = False) -> Any:
        """A client; `quick`: few retries and short timeouts (for `check`)."""
        session = boto3.session.Session()
        region = session.region_name or os.environ.get("AWS_REGION") or "us-east-1"
        config = Config(
            region_name=region,
            signature_version="s3v4",
            retries={"mode": "standard", "max_attempts": 2 if quick else 5},
            connect_timeout=2 if quick else 5,
            read_timeout=4 if quick else 60,
            max_pool_connections=2 * self.concurrency + 4,
            # No SHA-256 of every body for the signature (botocore signs payloads over
            # plain http unless told): each part's Content-MD5, which the signature covers,
            # and our own sha256 of the whole already vouch for the bytes; the signature's
            # hash was a third pass over each checkpoint (-20 % of the upload's CPU).
            s3={"payload_signing_enabled": False}
            | ({"addressing_style": "path"} if self.endpoint_url else {}),
            request_checksum_calculation="when_required",  # Content-MD5 is ours
            response_checksum_validation="when_required",  # the sha256 is checked instead
            tcp_keepalive=True,
        )
        return session.client("s3", endpoint_url=self.endpoint_url, config=config)

    @property
    def client(self) -> Any:
        """The one client of this backend, made on first use."""
        if self._client_obj is None:
            with self._client_lock:
                if self._client_obj is None:
                    self._client_obj = self._make_client()
        return self._client_obj

    def _where(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" + (
            f" at {self.endpoint_url}" if self.endpoint_url else ""
        )

    @contextlib.contextmanager
    def _errors(self, what: str, key: str) -> Iterator[None]:
        """botocore's errors as the storage's: FileNotFoundError, PermissionError,
        StorageUnavailable (or _PastEnd for a range past the end)."""
        try:
            yield
        except ClientError as e:
            code, status = _status(e)
            if code in _NOT_FOUND or (status == 404 and code != "NoSuchBucket"):
                raise FileNotFoundError(key) from None
            if code == "InvalidRange" or status == 416:
                raise _PastEnd(key) from None
            if code in _REFUSED or status == 403:
                raise PermissionError(f"{self._where()}: {what} {key}: refused ({code})") from e
            if status >= 500 or code in _BUSY or code == "NoSuchBucket":
                raise StorageUnavailable(f"{self._where()}: {what} {key}: {code}") from e
            raise OSError(f"{self._where()}: {what} {key}: {e}") from e
        except (NoCredentialsError, PartialCredentialsError) as e:
            raise PermissionError(
                f"{self._where()}: no credentials (set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY): {e}"
            ) from e
        except BotoCoreError as e:
            raise StorageUnavailable(f"{self._where()}: {what} {key}: {e}") from e

    def _retry(self, call: Callable[[], _T]) -> _T:
        """`call` again after a pause while the store is out of reach, TRIES times."""
        for attempt in range(TRIES):
            try:
                return call()
            except StorageUnavailable:
                if attempt == TRIES - 1:
                    raise
                time.sleep(BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")

    # ---------------------------------------------------------------- names

    def _name(self, key: str) -> str:
        """The object name of `key`; UnsafePath for a key the layout reserves."""
        clean = check_key(key)
        if split_piece(clean) is not None or clean.split("/")[0] == PROBE:
            raise UnsafePath(f"refused path {key!r}: a name the object store layout reserves")
        return self.root + clean

    def _key(self, name: str) -> str:
        return name[len(self.root) :]

    def describe(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._name(key)}"

    # ---------------------------------------------------------------- objects (pieces' side)

    def list_names(self, prefix: str) -> Iterator[Listed]:
        """Every object whose name starts with `prefix`, by name."""
        pages = self.client.get_paginator("list_objects_v2")
        with self._errors("list", prefix):
            for page in pages.paginate(Bucket=self.bucket, Prefix=prefix):
                for o in page.get("Contents", []):
                    yield Listed(o["Key"], int(o["Size"]), o["LastModified"].timestamp())

    def get_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object `name`."""
        if end <= start:
            return b""
        with self._errors("read", self._key(name)):
            r = self.client.get_object(
                Bucket=self.bucket, Key=name, Range=f"bytes={start}-{end - 1}"
            )
            return cast(bytes, r["Body"].read())

    def put_piece(self, name: str, src: BinaryIO, size: int) -> None:
        if size <= self.part_bytes:
            data = src.read()
            self._put(name, data, hashlib.sha256(data).hexdigest())
            return
        spool = self.staging_dir("spool") / f".{secrets.token_hex(8)}.tmp"
        try:  # a large compaction: spooled, so its parts can be read at once
            with open(spool, "w+b") as f:
                while block := src.read(COPY_BLOCK):
                    f.write(block)
                self._multipart(name, size, _file_reader(f.fileno()), None)
        finally:
            spool.unlink(missing_ok=True)

    def delete_names(self, names: Sequence[str]) -> None:
        for i in range(0, len(names), 1000):
            batch = [{"Key": n} for n in names[i : i + 1000]]
            with self._errors("delete", self._key(batch[0]["Key"])):
                r = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
            bad = [e for e in r.get("Errors", []) if e.get("Code") not in _NOT_FOUND]
            if bad:
                raise StorageUnavailable(f"{self._where()}: deleting {bad[0].get('Key')}: {bad[0]}")

    def adopt(self, base: str) -> int | None:
        head = self._head(base)
        if head is None:
            return None
        size = int(head["ContentLength"])
        piece = piece_name(base, 0, size)
        with self._errors("append to", self._key(base)):
            self.client.copy_object(
                Bucket=self.bucket, Key=piece, CopySource={"Bucket": self.bucket, "Key": base}
            )
        self.delete_names([base])
        return size

    def _head(self, name: str) -> dict[str, Any] | None:
        try:
            with self._errors("stat", self._key(name)):
                return cast(dict[str, Any], self.client.head_object(Bucket=self.bucket, Key=name))
        except FileNotFoundError:
            return None

    # ---------------------------------------------------------------- reading

    def stat(self, key: str) -> ObjectInfo:
        name = self._name(key)
        head = self._head(name)
        if head is not None:
            sha = head.get("Metadata", {}).get("sha256")
            return ObjectInfo(
                self._key(name), int(head["ContentLength"]), head["LastModified"].timestamp(), sha
            )
        pieces = self.log.pieces(name)
        if not pieces:
            raise FileNotFoundError(key)
        return ObjectInfo(self._key(name), pieces[-1].end, max(p.mtime for p in pieces))

    def _get(self, name: str, start: int, length: int | None) -> dict[str, Any]:
        end = "" if length is None else str(start + length - 1)
        with self._errors("read", self._key(name)):
            r = self.client.get_object(Bucket=self.bucket, Key=name, Range=f"bytes={start}-{end}")
            return cast(dict[str, Any], r)

    def open_read(self, key: str, start: int = 0, length: int | None = None) -> BinaryIO:
        name = self._name(key)
        if length is not None and length <= 0:
            self.stat(key)  # FileNotFoundError when there is none
            return io.BytesIO(b"")
        try:
            r = self._get(name, start, length)
        except _PastEnd:
            return io.BytesIO(b"")
        except FileNotFoundError:
            pieces = self.log.pieces(name)
            if not pieces:
                raise
            return self.log.stream(name, pieces, start, length)
        raw = _Body(r["Body"], lambda: self._errors("read", key))
        return cast(BinaryIO, io.BufferedReader(raw, COPY_BLOCK))

    def read_range(self, key: str, start: int, limit: int) -> tuple[bytes, int]:
        name = self._name(key)
        if limit <= 0:
            return b"", self.stat(key).size
        try:
            r = self._get(name, start, limit)
            with self._errors("read", key):
                data = r["Body"].read()
        except _PastEnd:
            return b"", self.stat(key).size
        except FileNotFoundError:
            got = self.log.read(name, start, limit)
            if got is None:
                raise
            return got
        total = str(r.get("ContentRange", "")).rpartition("/")[2]
        return data, int(total) if total.isdigit() else int(r["ContentLength"])

    def _look(self, name: str) -> tuple[Listed | None, list[Piece]]:
        """(the whole object, the pieces' chain) of one name from one LIST."""
        plain, pieces = None, []
        for item in self.list_names(name):
            split = split_piece(item.name)
            if item.name == name:
                plain = item
            elif split is not None and split[0] == name:
                pieces.append(split[1])
        return plain, chain(pieces)

    def open_tail(self, key: str, offset: int = 0) -> _Tail:
        return _Tail(self, key, self._name(key), offset)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        clean = check_key(prefix, allow_empty=True)
        found: dict[str, ObjectInfo] = {}
        groups: dict[str, list[Piece]] = {}
        for item in self.list_names(self.root + (f"{clean}/" if clean else "")):
            key = self._key(item.name)
            if key.startswith(f"{PROBE}/"):
                continue
            split = split_piece(item.name)
            if split is None:
                found[key] = ObjectInfo(key, item.size, item.mtime)
                continue
            base, p = split
            groups.setdefault(base, []).append(Piece(p.start, p.end, p.name, item.mtime))
        for base, pieces in groups.items():
            got = chain(pieces)
            if got and self._key(base) not in found:
                found[self._key(base)] = ObjectInfo(
                    self._key(base), got[-1].end, max(p.mtime for p in got)
                )
        return iter(sorted(found.values(), key=lambda o: o.key))

    # ---------------------------------------------------------------- writing

    def _part_size(self, size: int) -> int:
        return max(self.part_bytes, -(-size // MAX_PARTS))

    def _put(self, name: str, data: bytes, sha: str) -> None:
        md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
        with self._errors("write", self._key(name)):
            self.client.put_object(
                Bucket=self.bucket, Key=name, Body=data, ContentMD5=md5, Metadata={"sha256": sha}
            )

    def _store_bytes(self, key: str, data: bytes, sha256: str | None) -> ObjectInfo:
        name = self._name(key)
        got = hashlib.sha256(data).hexdigest()
        _verify(self.describe(key), got, sha256)
        if len(data) <= self.part_bytes:
            self._retry(lambda: self._put(name, data, got))
        else:
            self._multipart(name, len(data), lambda off, n: data[off : off + n], got)
        self._written(name)
        return ObjectInfo(self._key(name), len(data), time.time(), got)

    def write_bytes(self, key: str, data: bytes | memoryview) -> ObjectInfo:
        return self._store_bytes(key, bytes(data), None)

    def write_stream(self, key: str, src: IO[bytes]) -> ObjectInfo:
        """One part or less: one PUT. More: spooled to a file in the cache first (so the
        sha256 is known when the upload starts), then uploaded as that file."""
        head = _read_up_to(src, self.part_bytes + 1)
        if len(head) <= self.part_bytes:
            return self._store_bytes(key, head, None)
        self._name(key)
        spool = self.staging_dir("spool") / f".{secrets.token_hex(8)}.tmp"
        try:
            h = hashlib.sha256(head)
            with open(spool, "xb") as out:
                out.write(head)
                while block := src.read(COPY_BLOCK):
                    h.update(block)
                    out.write(block)
            return self.write_file(key, spool, sha256=h.hexdigest())
        finally:
            spool.unlink(missing_ok=True)

    def write_file(
        self, key: str, path: Path, *, move: bool = False, sha256: str | None = None
    ) -> ObjectInfo:
        name = self._name(key)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= self.part_bytes:
                info = self._store_bytes(key, f.read(), sha256)
            else:
                want = sha256
                if want is None:  # the metadata goes first: hash the file before
                    want = sha256_file(f)
                    f.seek(0)
                self._multipart(name, size, _file_reader(f.fileno()), want)
                self._written(name)
                info = ObjectInfo(self._key(name), size, time.time(), want)
        if move:
            Path(path).unlink(missing_ok=True)
        return info

    def _multipart(
        self, name: str, size: int, read: Callable[[int, int], bytes], sha: str | None
    ) -> None:
        """A multipart upload of `size` bytes (`read(offset, n)` gives them), `concurrency`
        parts at a time; their sha256 (hashed in order as the parts are read) must be `sha`
        (None: not checked, no metadata). Any failure aborts it: no object, no parts left."""
        key = self._key(name)
        step = self._part_size(size)
        ranges = [(off, min(step, size - off)) for off in range(0, size, step)]
        meta = {"Metadata": {"sha256": sha}} if sha else {}
        with self._errors("write", key):
            upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=name, **meta)
        upload_id = upload["UploadId"]
        try:
            etags, got = _Parts(self, name, upload_id, ranges, read).send()
            if sha is not None:
                _verify(f"s3://{self.bucket}/{name}", got, sha)
            done = [{"ETag": tag, "PartNumber": n} for n, tag in enumerate(etags, 1)]
            with self._errors("write", key):
                self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=name,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": done},
                )
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)
            raise

    def _put_part(self, name: str, upload_id: str, n: int, data: bytes, md5: str) -> str:
        """Part `n` (`md5`: its Content-MD5, base64), retried while the store is out of
        reach."""

        def send() -> str:
            with self._errors(f"write part {n} of", self._key(name)):
                r = self.client.upload_part(
                    Bucket=self.bucket,
                    Key=name,
                    UploadId=upload_id,
                    PartNumber=n,
                    Body=data,
                    ContentMD5=md5,
                )
            return cast(str, r["ETag"])

        return self._retry(send)

    def _written(self, name: str) -> None:
        """A whole object was written at `name`: any pieces of an earlier append go."""
        self.log.forget(name)
        stale = [i.name for i in self.list_names(name + PIECES)]
        if stale:
            self.delete_names(stale)

    def append(self, key: str, data: bytes) -> None:
        """A new piece (storage/pieces.py). One appender per key at a time: this process
        keeps the key's end in memory, so appends to one key from two hosts (or two
        backends) at once would overwrite each other's pieces."""
        self.log.append(self._name(key), bytes(data))

    def delete(self, key: str) -> bool:
        name = self._name(key)
        whole = self._head(name) is not None
        names = [i.name for i in self.list_names(name + PIECES)]
        self.log.forget(name)
        if whole or names:
            self.delete_names(([name] if whole else []) + names)
        return whole or bool(names)

    # ---------------------------------------------------------------- on this host

    def local_path(self, key: str) -> None:
        self._name(key)
        return None

    def staging_dir(self, prefix: str) -> Path:
        folder = self.cache.root / check_key(prefix) / "tmp"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def run_dir(self, job_id: str) -> Path:
        return self.cache.root / job_prefix(job_id)

    def presign(self, key: str, expires_s: int, filename: str | None = None) -> str:
        params = {"Bucket": self.bucket, "Key": self._name(key)}
        if filename is not None:  # the stored name carries its sha256: say the file's own
            params["ResponseContentDisposition"] = (
                f'attachment; filename="{_SAFE_NAME.sub("_", filename)}"'
            )
        url = self.client.generate_presigned_url(
            "get_object", Params=params, ExpiresIn=int(expires_s)
        )
        return cast(str, url)

    def local_copy(self, key: str, sha256: str | None = None) -> Path:
        """The object at `<cache>/<key>`: the cached file when it matches (`sha256`, else
        the stored size), else downloaded, checked against `sha256` (or the object's own),
        then renamed into place. ChecksumMismatch leaves no file."""
        name, clean = self._name(key), check_key(key)
        target = self._cache_target(clean)
        if self._cached(clean, key, sha256):
            return target
        info = self.stat(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            with os.fdopen(fd, "r+b") as out:
                if info.sha256 is not None:  # a whole object: ranges at once
                    got = self._download(name, info.size, out.fileno())
                else:
                    got = self._copy_stream(key, out)
                _verify(self.describe(key), got, sha256 or info.sha256)
                os.fsync(out.fileno())
            self.cache.local_path(clean)  # UnsafePath if a link was planted meanwhile
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return target

    def _cache_target(self, clean: str) -> Path:
        """`<cache>/<key>`: a link planted there is removed (never followed), a link in a
        folder on the way refused (UnsafePath)."""
        target = self.cache.root / clean
        try:
            self.cache.local_path(clean)
        except UnsafePath:
            parent = clean.rpartition("/")[0]
            if parent:
                self.cache.local_path(parent)
            if not target.is_symlink():
                raise
            target.unlink()
        return target

    def _cached(self, clean: str, key: str, sha256: str | None) -> bool:
        try:
            have = self.cache.stat(clean)
            if sha256 is not None:
                with self.cache.open_read(clean) as f:
                    return sha256_file(f) == sha256
        except (FileNotFoundError, UnsafePath):
            return False
        try:
            return have.size == self.stat(key).size
        except FileNotFoundError:
            return False

    def _copy_stream(self, key: str, out: IO[bytes]) -> str:
        h = hashlib.sha256()
        with self.open_read(key) as src:
            while block := src.read(COPY_BLOCK):
                h.update(block)
                out.write(block)
        out.flush()
        return h.hexdigest()

    def _download(self, name: str, size: int, fd: int) -> str:
        """The object into the file `fd` in concurrent ranged GETs; the sha256 of what was
        written, hashed in order as the ranges land."""
        step = self.part_bytes
        ranges = [(off, min(step, size - off)) for off in range(0, size, step)]
        h = hashlib.sha256()
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="s3-get") as pool:
            futures = [pool.submit(self._fetch, name, off, n, fd) for off, n in ranges]
            try:
                for (off, n), fut in zip(ranges, futures, strict=True):
                    fut.result()
                    for at in range(off, off + n, 8 << 20):
                        h.update(os.pread(fd, min(8 << 20, off + n - at), at))
            finally:
                for fut in futures:
                    fut.cancel()
        return h.hexdigest()

    def _fetch(self, name: str, off: int, n: int, fd: int) -> None:
        def once() -> None:
            r = self._get(name, off, n)
            got = 0
            with self._errors("read", self._key(name)):
                for chunk in r["Body"].iter_chunks(COPY_BLOCK):
                    os.pwrite(fd, chunk, off + got)
                    got += len(chunk)
            if got != n:
                raise StorageUnavailable(f"{self._where()}: {name}: {got} of {n} bytes came")

        self._retry(once)

    # ---------------------------------------------------------------- start-up check

    def check(self) -> None:
        """The bucket is there, and a probe object can be written, read back and removed
        with these credentials; StorageConfigError naming the setting to fix, in seconds
        (few retries, short timeouts) even when the endpoint is out of reach."""
        client = self._make_client(quick=True)
        probe = f"{self.root}{PROBE}/{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        body = secrets.token_bytes(16)
        try:
            client.head_bucket(Bucket=self.bucket)
            client.put_object(Bucket=self.bucket, Key=probe, Body=body)
            back = client.get_object(Bucket=self.bucket, Key=probe)["Body"].read()
            client.delete_object(Bucket=self.bucket, Key=probe)
        except ClientError as e:
            raise StorageConfigError(self._refusal(e)) from None
        except (NoCredentialsError, PartialCredentialsError):
            raise StorageConfigError(
                f"no S3 credentials for {self._where()}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY"
            ) from None
        except BotoCoreError as e:
            endpoint = self.endpoint_url or "AWS S3's own endpoint"
            raise StorageConfigError(
                f"cannot reach the S3 endpoint {endpoint} ({e}): check "
                "TORCHYARD_S3_ENDPOINT_URL (and that the store is running)"
            ) from None
        if back != body:
            raise StorageConfigError(f"{self._where()}: a probe object read back changed")

    def _refusal(self, e: ClientError) -> str:
        code, status = _status(e)
        if code == "NoSuchBucket" or status == 404:
            return (
                f"the bucket {self.bucket!r} does not exist at "
                f"{self.endpoint_url or 'AWS S3'}: create it, or fix TORCHYARD_STORAGE_URL"
            )
        if code in _REFUSED or status == 403:
            return (
                f"{self._where()} refused the credentials ({code}): check "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            )
        return f"{self._where()} answered {code} ({status}) to the start-up check: {e}"

    def __repr__(self) -> str:
        return f"S3Storage({self._where()!r})"


def _verify(name: str, got: str, want: str | None) -> None:
    if want is not None and got != want:
        raise ChecksumMismatch(f"{name}: its bytes hash to {got}, not {want}")


def _read_up_to(src: IO[bytes], n: int) -> bytes:
    out = bytearray()
    while len(out) < n and (block := src.read(n - len(out))):
        out += block
    return bytes(out)


def _file_reader(fd: int) -> Callable[[int, int], bytes]:
    """`read(offset, n)` of an open file: exactly n bytes (the file must not shrink)."""

    def read(off: int, n: int) -> bytes:
        data = os.pread(fd, n, off)
        if len(data) != n:
            raise OSError(f"the file changed while it was uploaded ({len(data)} of {n} bytes)")
        return data

    return read


class _Parts:
    """One multipart upload's parts on their way. This thread reads the bytes once in
    order, in blocks, for the sha256 of the whole and each part's MD5; as soon as a part
    is hashed and a slot is free (at most `concurrency` parts in memory), a pool thread
    reads that part again and sends it with that Content-MD5, so the store refuses a part
    whose bytes are not the ones hashed. Hashing runs ahead of the sends: a slot that
    frees is filled at once, never after a burst of hashing. The first failure stops the
    rest."""

    def __init__(
        self,
        storage: S3Storage,
        name: str,
        upload_id: str,
        ranges: list[tuple[int, int]],
        read: Callable[[int, int], bytes],
    ) -> None:
        self.s, self.name, self.upload_id = storage, name, upload_id
        self.ranges, self.read = ranges, read
        self.slots = threading.Semaphore(storage.concurrency)

    def _job(self, i: int, md5: str) -> str:
        off, n = self.ranges[i]
        data = self.read(off, n)
        return self.s._put_part(self.name, self.upload_id, i + 1, data, md5)

    def _hash(self, h: Any, off: int, n: int) -> str:
        md5 = hashlib.md5()
        for at in range(off, off + n, HASH_BLOCK):
            block = self.read(at, min(HASH_BLOCK, off + n - at))
            h.update(block)
            md5.update(block)
        return base64.b64encode(md5.digest()).decode()

    def send(self) -> tuple[Sequence[str], str]:
        """(the parts' ETags, the sha256 of all their bytes)."""
        h = hashlib.sha256()
        uploads: list[Future[str]] = []
        with ThreadPoolExecutor(self.s.concurrency, thread_name_prefix="s3-put") as pool:
            try:
                for i, (off, n) in enumerate(self.ranges):
                    md5 = self._hash(h, off, n)
                    self.slots.acquire()
                    if any(f.done() and f.exception() for f in uploads):
                        break
                    fut = pool.submit(self._job, i, md5)
                    fut.add_done_callback(lambda _: self.slots.release())
                    uploads.append(fut)
                return [f.result() for f in uploads], h.hexdigest()
            finally:
                for f in uploads:
                    f.cancel()


class _Body(io.RawIOBase):
    """A GET's streaming body, its errors the storage's (StorageUnavailable)."""

    def __init__(self, body: Any, errors: Callable[[], contextlib.AbstractContextManager[None]]):
        super().__init__()
        self._body, self._errors = body, errors

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:  # any writable buffer (bytearray, memoryview)
        view = memoryview(buffer).cast("B")
        with self._errors():
            data = self._body.read(len(view))
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._body.close()
        super().close()


class _Tail:
    """An appended object read as it grows: one LIST a read when nothing changed."""

    def __init__(self, storage: S3Storage, key: str, name: str, offset: int) -> None:
        self._storage, self._key, self._name, self.offset = storage, key, name, offset
        self.more = False  # the last read stopped at TAIL_READ: there is more already

    def read(self) -> bytes:
        plain, pieces = self._storage._look(self._name)
        size = plain.size if plain is not None else (pieces[-1].end if pieces else 0)
        self.more = False
        if size <= self.offset:
            return b""
        try:
            data, size = self._storage.read_range(self._key, self.offset, TAIL_READ)
        except FileNotFoundError:
            return b""
        self.offset += len(data)
        self.more = self.offset < size
        return data

    def close(self) -> None:
        pass
