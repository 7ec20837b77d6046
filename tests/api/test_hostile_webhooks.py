"""Hostile webhooks (issue 42): by default a webhook reaches the public internet only.
Loopback, private, link-local (cloud metadata), NAT64 and 6to4 destinations are refused
when the webhook is created (a literal address: 422 naming `url`) and at every send (a
name resolving there: a failed try saying why, nothing connected), an IPv4 address
embedded in an IPv6 one (IPv4-mapped, NAT64, 6to4) judged as that IPv4 address;
TORCHYARD_WEBHOOK_ALLOW_NETWORKS opens a network, TORCHYARD_WEBHOOK_DENY_NETWORKS closes
one whatever the allow list says."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from support.db import Factory

from torchyard.scheduler.notify import Notifier
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import WebhookAttempt
from torchyard.store.states import FAILED, RUNNING
from torchyard.store.webhooks import create_webhook

pytestmark = pytest.mark.hostile

HOSTILE = ["127.0.0.1", "10.1.2.3", "169.254.169.254", "::1", "64:ff9b::7f00:1",
           "2002:7f00:1::", "::ffff:10.0.0.1", "100.64.0.1", "fd00::1", "0.0.0.0",
           "224.0.0.1"]  # fmt: skip


def _literal(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def test_a_non_public_literal_address_is_refused_at_create(
    client: TestClient, alice: dict[str, str]
) -> None:
    for address in HOSTILE:
        url = f"http://{_literal(address)}:8080/hook"
        r = client.post("/v1/webhooks", json={"url": url, "events": ["job.failed"]},
                        headers=alice)  # fmt: skip
        assert r.status_code == 422, (address, r.text)
        (detail,) = r.json()["error"]["details"]
        assert detail["field"] == "url" and "TORCHYARD_WEBHOOK_" in detail["message"]
    assert client.get("/v1/webhooks", headers=alice).json()["items"] == []
    r = client.post("/v1/webhooks", json={"url": "http://93.184.215.14/h", "events": ["job.failed"]},
                    headers=alice)  # fmt: skip
    assert r.status_code == 201, r.text  # a public address is fine


def test_a_name_resolving_to_a_non_public_address_is_refused_at_send(
    factory: Factory, settings: Settings, db_url: str
) -> None:
    """DNS rebinding: each webhook names a host that resolves (at send) to one hostile
    address; every try is refused before any connection, saying why."""
    owner = factory.user_id("alice")
    with session_scope(db_url) as s:
        for i in range(len(HOSTILE)):
            create_webhook(s, owner, None, f"http://h{i}.example/x", ["job.failed"], "s" * 16)
    factory.set_state(factory.job("alice", RUNNING), FAILED, error="boom")
    to = {f"h{i}.example": a for i, a in enumerate(HOSTILE)}
    sender = Notifier(settings.model_copy(update={"webhook_timeout_s": 0.5}),
                      resolver=lambda host, port: [to[host]])  # fmt: skip
    try:
        assert sender.pass_once() == len(HOSTILE)
    finally:
        sender.close()
    with session_scope(db_url) as s:
        errors = [a.error or "" for a in s.scalars(select(WebhookAttempt))]
    assert len(errors) == len(HOSTILE)
    for e in errors:  # refused by the guard, not a connection that failed
        assert e.startswith("refused: ") and "resolves to" in e, e


def test_the_allow_list_opens_a_network_but_not_what_hides_inside_it() -> None:
    """Allowing NAT64 (an IPv6-only host's way out) reaches public IPv4 addresses through
    it, never loopback or metadata hidden in it; the deny list wins over the allow list."""
    from torchyard.scheduler.webhook_guard import rule_for

    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    allowing = settings.model_copy(
        update={"webhook_allow_networks": "127.0.0.1/32,64:ff9b::/96,2002::/16,10.0.0.0/8"}
    )
    rule = rule_for(allowing)
    assert rule.refusal("127.0.0.1") is None and rule.refusal("10.9.8.7") is None
    assert rule.refusal("64:ff9b::808:808") is None  # 8.8.8.8 through NAT64
    assert rule.refusal("127.0.0.2") is not None  # only the /32 was allowed
    for inside in ("64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::1", "64:ff9b::c0a8:1"):
        assert rule.refusal(inside) is not None, inside  # metadata, private v4 inside
    assert rule.refusal("64:ff9b::7f00:1") is None  # 127.0.0.1 itself is allowed here
    denying = allowing.model_copy(update={"webhook_deny_networks": "10.9.0.0/16"})
    assert "TORCHYARD_WEBHOOK_DENY_NETWORKS" in (rule_for(denying).refusal("10.9.8.7") or "")
    for address in HOSTILE:
        assert rule_for(settings).refusal(address) is not None, address
    assert rule_for(settings).refusal("2606:4700::1111") is None
