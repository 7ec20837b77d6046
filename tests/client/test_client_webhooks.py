"""`torchyard webhook create|list|delete|deliveries` and the SDK's webhook calls, against
the real API (a TestClient of create_app on SQLite)."""

from __future__ import annotations

import json

from client_server import Run

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
