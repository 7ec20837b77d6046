"""The embedded broker (broker/fs_transport.py) under concurrent producers and consumers: every
message arrives exactly once and no consumer dies. kombu's own filesystem transport let a
consumer take a message file before its producer had written it; the empty read killed the
scheduler with a JSONDecodeError (issue "the first hour", item 1)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import time
from pathlib import Path
from typing import Any

import pytest

from torchyard.broker.app import transport_options, use_fixed_filesystem_transport

PRODUCERS, CONSUMERS, EACH = 4, 3, 250
QUEUE = "hammer"


def _options(root: Path) -> dict[str, Any]:
    """The embedded broker's own options (broker/app.py), in `root`, polled faster."""
    from torchyard.settings import Settings

    settings = Settings(_env_file=None, home=root)  # type: ignore[call-arg]
    return transport_options(settings) | {"polling_interval": 0.005}


def _connection(root: Path) -> Any:
    from kombu import Connection

    use_fixed_filesystem_transport()
    return Connection("filesystem://", transport_options=_options(root))


def _produce(root: Path, who: int) -> None:
    with _connection(root) as conn:
        q = conn.SimpleQueue(QUEUE)
        for i in range(EACH):
            q.put({"who": who, "i": i, "pad": "x" * (i % 7 * 300)})
        q.close()


def _consume(root: Path, out: Path, stop: Any) -> None:
    got = []
    with _connection(root) as conn:
        q = conn.SimpleQueue(QUEUE)
        while not stop.is_set():
            try:
                m = q.get(timeout=0.05)
            except queue.Empty:
                continue
            got.append([m.payload["who"], m.payload["i"]])
            m.ack()
        q.close()
    out.write_text(json.dumps(got))


def test_concurrent_producers_and_consumers_lose_and_double_nothing(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    outs = [tmp_path / f"consumer{k}.json" for k in range(CONSUMERS)]
    consumers = [ctx.Process(target=_consume, args=(tmp_path, o, stop)) for o in outs]
    producers = [ctx.Process(target=_produce, args=(tmp_path, w)) for w in range(PRODUCERS)]
    for p in consumers + producers:
        p.start()
    try:
        for p in producers:
            p.join(timeout=120)
            assert p.exitcode == 0
        # Drained: no message file is left in the queue folder.
        deadline = 120.0
        t0 = time.monotonic()
        while any(
            n.endswith(f"{QUEUE}.msg") for n in os.listdir(_options(tmp_path)["data_folder_in"])
        ):
            assert time.monotonic() - t0 < deadline, "consumers stopped draining"
            assert all(c.is_alive() for c in consumers), "a consumer died"
            time.sleep(0.05)
    finally:
        stop.set()
        for c in consumers:
            c.join(timeout=30)
    assert [c.exitcode for c in consumers] == [0] * CONSUMERS  # none crashed
    got = [tuple(x) for o in outs for x in json.loads(o.read_text())]
    assert len(got) == len(set(got)), "a message was delivered twice"
    assert set(got) == {(w, i) for w in range(PRODUCERS) for i in range(EACH)}


def test_a_message_being_written_is_invisible_and_a_bad_one_is_skipped(tmp_path: Path) -> None:
    with _connection(tmp_path) as conn:
        q = conn.SimpleQueue(QUEUE)
        folder = Path(_options(tmp_path)["data_folder_in"])
        # What a producer mid-write leaves: a hidden temporary file (never a .msg).
        (folder / ".tmp-0123abcd").write_bytes(b'{"body": "half')
        # A damaged message (e.g. written by kombu's own transport and read too early).
        (folder / f"1_00000000-0000-0000-0000-000000000000.{QUEUE}.msg").write_bytes(b"")
        q.put({"ok": 1})
        m = q.get(timeout=5)
        assert m.payload == {"ok": 1}
        m.ack()
        with pytest.raises(queue.Empty):
            q.get(timeout=0.2)
        assert (folder / ".tmp-0123abcd").exists()  # not consumed
        # One a killed producer left long ago is cleaned up by the next poll.
        old = folder / ".tmp-deadbeef"
        old.write_bytes(b"{")
        os.utime(old, (time.time() - 3600, time.time() - 3600))
        with pytest.raises(queue.Empty):
            q.get(timeout=0.2)
        assert not old.exists() and (folder / ".tmp-0123abcd").exists()
        q.close()
