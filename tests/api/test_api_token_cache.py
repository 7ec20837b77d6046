"""The token cache shares one lookup between the requests that miss at once (api/deps.py).

A busy client keeps dozens of requests in flight with one token; when its cache entry
expired, each of them used to queue its own token query for the API's few store threads,
and the whole burst waited (bench/api_bench.py's tail latency, every 5 s)."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import httpx
import pytest
from support.db import Factory

from torchyard.api import deps
from torchyard.api.app import create_app
from torchyard.api.deps import Principal, TokenCache
from torchyard.settings import Settings

ALICE = Principal(1, "alice", is_admin=False)


@pytest.mark.anyio
async def test_requests_that_miss_together_make_one_token_query(
    settings: Settings, factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = factory.token("alice")
    job = factory.job("alice")
    calls: list[float] = []
    lock = threading.Lock()
    real_lookup = deps._lookup

    def slow_lookup(*args, **kwargs):  # type: ignore[no-untyped-def]
        with lock:
            calls.append(time.monotonic())
        time.sleep(0.2)  # long enough for the whole burst to arrive while it runs
        return real_lookup(*args, **kwargs)

    monkeypatch.setattr(deps, "_lookup", slow_lookup)
    app = create_app(settings)
    auth = {"Authorization": f"Bearer {token}"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as c:
        for burst in (1, 2):  # a cold cache, then an expired entry
            app.state.token_cache.clear()
            with anyio.fail_after(10):
                replies = await asyncio.gather(
                    *[c.get(f"/v1/jobs/{job}", headers=auth) for _ in range(24)]
                )
            assert [r.status_code for r in replies] == [200] * 24
            assert len(calls) == burst, f"burst {burst}: {len(calls)} token queries"
        bad = await c.get(f"/v1/jobs/{job}", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401  # an unknown token is never cached, nor let through


def test_a_failed_lookup_fails_every_waiter_and_the_next_request_asks_again() -> None:
    async def main() -> None:
        cache = TokenCache()
        loads = 0
        store_down = True

        async def load() -> Principal | None:
            nonlocal loads
            loads += 1
            await asyncio.sleep(0.05)
            if store_down:
                raise ConnectionError("store unreachable")
            return ALICE

        results = await asyncio.gather(
            *[cache.fetch("h", load) for _ in range(5)], return_exceptions=True
        )
        assert loads == 1
        assert all(isinstance(r, ConnectionError) for r in results), results
        store_down = False
        assert await cache.fetch("h", load) == ALICE
        assert loads == 2
        assert await cache.fetch("h", load) == ALICE  # cached now
        assert loads == 2

    asyncio.run(main())


def test_a_waiter_that_goes_away_leaves_the_lookup_to_the_others() -> None:
    async def main() -> None:
        cache = TokenCache()
        loads = 0

        async def load() -> Principal | None:
            nonlocal loads
            loads += 1
            await asyncio.sleep(0.1)
            return ALICE

        first = asyncio.ensure_future(cache.fetch("h", load))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(cache.fetch("h", load))
        await asyncio.sleep(0.01)
        first.cancel()  # its client disconnected
        assert await second == ALICE
        assert first.cancelled() and loads == 1
        assert cache.get("h") == ALICE

    asyncio.run(main())


def test_a_logout_during_the_lookup_is_not_undone_by_it() -> None:
    async def main() -> None:
        cache = TokenCache()
        started = asyncio.Event()

        async def load() -> Principal | None:
            started.set()
            await asyncio.sleep(0.05)
            return ALICE

        pending = asyncio.ensure_future(cache.fetch("session:h", load))
        await started.wait()
        cache.drop("session:h")  # the session ended while its lookup ran
        assert await pending == ALICE  # that request began before the logout
        assert cache.get("session:h") is None  # but nothing after it is let in from cache

    asyncio.run(main())


def test_drop_user_forgets_every_credential_of_the_user_and_lookups_under_way() -> None:
    """PATCH /v1/users/{name} drops the user's entries: a lookup that read the user before
    the change must not put the old rights back."""

    async def main() -> None:
        cache = TokenCache()
        bob = Principal(2, "bob", is_admin=False)
        cache.put("a", ALICE)
        cache.put("session:b", ALICE)
        cache.put("c", bob)
        started = asyncio.Event()

        async def load() -> Principal | None:
            started.set()
            await asyncio.sleep(0.05)
            return ALICE  # as read before the change

        pending = asyncio.ensure_future(cache.fetch("d", load))
        await started.wait()
        cache.drop_user(ALICE.id)
        assert await pending == ALICE
        assert [cache.get(k) for k in ("a", "session:b", "c", "d")] == [None, None, bob, None]

    asyncio.run(main())
