"""A job's artifacts on its page in a real browser against a real API process (no worker:
the files and rows are written as a worker leaves them): the table with a download link
each (the file downloaded is the one whose sha256 is listed), the PNG shown inline, a file
named .png that holds HTML neither shown nor run, and a job without artifacts saying so."""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_lib import SQLITE, backend_world, login, token_for
from seed import finished_job, user_id
from support.worker_cluster import Cluster

from torchyard.store.artifacts import record_artifact
from torchyard.store.paths import job_dir

pytestmark = pytest.mark.browser

SHOTS = Path("/tmp/artifact-shots")  # where the lead looks at them
EVIL = b"<html><body><script>document.title='pwned'</script>pwned</body></html>"


def confusion_png(n: int = 10, cell: int = 24) -> bytes:
    """A confusion matrix as a PNG drawn with the standard library: a strong diagonal."""
    rows = []
    for y in range(n * cell):
        line = bytearray(b"\0")
        for x in range(n * cell):
            i, j = y // cell, x // cell
            v = 230 if i == j else (60 if abs(i - j) == 1 else 12)
            line += bytes((255 - v, 255 - v // 2, 255))
        rows.append(bytes(line))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    head = struct.pack(">IIBBBBB", n * cell, n * cell, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head)
            + chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b""))  # fmt: skip


PNG = confusion_png()
FILES = {"confusion.png": PNG, "config.yaml": b"lr: 0.05\nbatch_size: 64\n", "evil.png": EVIL}


class World:
    def __init__(self, c: Cluster):
        self.c, self.base = c, c.url
        self.alice = token_for(c, "alice")
        with c.session() as s:
            uid = user_id(s, "alice")
            self.job = finished_job(s, uid, "with-artifacts")
            self.bare = finished_job(s, uid, "without-artifacts")
        for name, data in FILES.items():
            target = job_dir(c.storage, self.job) / "artifacts" / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            with c.session() as s:
                record_artifact(s, self.job, name=name, bytes=len(data),
                                sha256=hashlib.sha256(data).hexdigest())  # fmt: skip


@pytest.fixture(scope="module", params=[SQLITE])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    yield from backend_world(request, tmp_path_factory, "artifacts", World)


def test_the_job_page_lists_artifacts_downloads_them_and_shows_the_image(
    world: World, new_page: Callable[[], Any], keep: Callable[[Any, str], None], tmp_path: Path
) -> None:
    page = new_page()
    login(page, world.base, world.alice, f"/jobs/{world.job}")
    page.wait_for_selector("#artifacts tbody tr")
    rows = page.query_selector_all("#artifacts tbody tr")
    assert [r.get_attribute("data-name") for r in rows] == [
        "config.yaml",
        "confusion.png",
        "evil.png",
    ]
    sha = page.query_selector("#artifacts tr[data-name='confusion.png'] .sha").text_content()
    assert sha == hashlib.sha256(PNG).hexdigest()
    # The PNG is shown, decoded by the browser (fetched with the session's cookie).
    img = page.wait_for_selector("#artifact-images figure[data-name='confusion.png'] img")
    page.wait_for_function("(img) => img.complete && img.naturalWidth > 0", arg=img)
    assert img.evaluate("(img) => img.naturalWidth") == 240
    # HTML named .png is served as an octet-stream attachment: no picture, nothing run.
    page.wait_for_function(
        "() => !document.querySelector(\"#artifact-images figure[data-name='evil.png']\")"
    )
    assert page.title() != "pwned"
    keep(page, "job-artifacts")
    with page.expect_download() as dl:
        page.click("#artifacts tr[data-name='config.yaml'] a.download")
    saved = tmp_path / "config.yaml"
    dl.value.save_as(saved)
    assert (
        hashlib.sha256(saved.read_bytes()).hexdigest()
        == hashlib.sha256(FILES["config.yaml"]).hexdigest()
    )


def test_a_job_without_artifacts_says_so(world: World, new_page: Callable[[], Any]) -> None:
    page = new_page()
    login(page, world.base, world.alice, f"/jobs/{world.bare}")
    assert "job.save_artifact" in page.wait_for_selector("#no-artifacts").text_content()
