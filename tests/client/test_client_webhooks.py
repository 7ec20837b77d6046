"""`torchyard webhook create|list|delete|deliveries` and the SDK's webhook calls, against
the real API (a TestClient of create_app on SQLite)."""

from __future__ import annotations

import json

import pytest
from client_server import Run

from torchyard.client import errors
from torchyard.client.sdk import Client


def test_webhook_commands(run: Run, ty: Client) -> None:
    rc, out, err = run("webhook", "create", "http://hooks.example:9/h", "--event", "job.failed",
                       "--event", "sweep.completed", "--secret", "s3cret-s3cret-s3cret")  # fmt: skip
    assert rc == 0, err
    assert out.strip() == "s3cret-s3cret-s3cret" and "shown this once" in err
    (hook,) = ty.webhooks()
    assert hook["events"] == ["job.failed", "sweep.completed"] and "s3cret" not in hook["secret"]
    rc, out, _ = run("webhook", "list")
    assert rc == 0 and hook["id"] in out and "hooks.example" in out and "s3cret-s3" not in out
    rc, out, _ = run("webhook", "deliveries", hook["id"], "--json")
    assert rc == 0 and json.loads(out) == []
    rc, out, err = run("webhook", "create", "http://169.254.169.254/", "--event", "job.failed")
    assert rc == 2 and "url" in err and "denied" in err
    rc, _, err = run("webhook", "create", "http://hooks.example:9/h", "--event", "job.exploded")
    assert rc == 2 and "invalid choice" in err
    rc, _, err = run("webhook", "delete", hook["id"])
    assert rc == 0 and "deleted" in err
    assert ty.webhooks() == []
    rc, _, err = run("webhook", "delete", hook["id"])
    assert rc != 0 and "not found" in err


def _two_sharing_a_first_digit(ty: Client) -> tuple[str, str]:
    """Two webhooks whose ids begin alike (at most 17 webhooks make sure of it)."""
    seen: dict[str, str] = {}
    while True:
        hook = ty.create_webhook("http://hooks.example:9/h", ["job.failed"])["id"]
        if hook[0] in seen:
            return seen[hook[0]], hook
        seen[hook[0]] = hook


def test_webhook_ids_take_a_unique_prefix_as_job_ids_do(run: Run, ty: Client) -> None:
    a, b = _two_sharing_a_first_digit(ty)
    rc, out, err = run("webhook", "deliveries", a[:8], "--json")
    assert (rc, json.loads(out)) == (0, []), err
    rc, _, err = run("webhook", "deliveries", a[0])
    assert rc == 2 and err.startswith(f"error: {a[0]} matches ") and err.count("\n") == 1
    assert a[:12] in err and b[:12] in err and "give more of the id" in err
    with pytest.raises(errors.AmbiguousId) as e:
        ty.delete_webhook(a[0])
    assert set(e.value.matches) >= {a, b}
    unused = next(c for c in "0123456789abcdef" if not any(h["id"][0] == c for h in ty.webhooks()))
    rc, _, err = run("webhook", "delete", unused)
    assert rc == 1 and "no webhook id starts with" in err
    rc, _, err = run("webhook", "delete", b[:10])
    assert rc == 0 and f"webhook {b} deleted" in err  # the full id, not the prefix
    assert b not in {h["id"] for h in ty.webhooks()}
