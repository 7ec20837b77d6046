"""A worker started as root says nothing of Celery's "--uid" (issue 44, item 13): torchyard
drops privileges itself (worker/sandbox.py), so broker/app.py's make_consumer silences
exactly Celery's superuser warning, and no other of its security warnings."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from celery.exceptions import SecurityWarning

from torchyard.broker.app import make_celery, make_consumer
from torchyard.settings import Settings


def _settings(root: Path) -> Settings:
    return Settings(_env_file=None, home=root / "home", broker_url=None)  # type: ignore[call-arg]


def test_root_consumer_has_no_superuser_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Root as Celery sees it (celery/platforms.py check_privileges), whoever runs the tests.
    for name in ("getuid", "geteuid", "getgid", "getegid"):
        monkeypatch.setattr(os, name, lambda: 0)
    app = make_celery(_settings(tmp_path))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        make_consumer(app, name="w1", queue="q")
        logging.captureWarnings(False)  # Celery's logging setup sent warnings to logging
        warnings.warn(SecurityWarning("some other security warning"), stacklevel=1)
    said = [str(w.message) for w in seen]
    assert not [m for m in said if "superuser" in m or "--uid" in m], said
    assert "some other security warning" in said  # only that warning is silenced


def test_pickle_app_keeps_celerys_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not JSON-only: the silencing does not apply, and Celery still refuses root."""
    from celery.exceptions import SecurityError

    for name in ("getuid", "geteuid", "getgid", "getegid"):
        monkeypatch.setattr(os, name, lambda: 0)
    monkeypatch.delenv("C_FORCE_ROOT", raising=False)
    app = make_celery(_settings(tmp_path))
    app.conf.accept_content = ["json", "pickle"]
    with pytest.raises(SecurityError):
        make_consumer(app, name="w1", queue="q")


@pytest.mark.skipif(os.geteuid() != 0, reason="the start-up output as root needs root")
def test_root_worker_start_up_output(tmp_path: Path) -> None:
    """What a root process prints when it makes its consumer, with Python's default
    warning filters (what `torchyard worker` runs with)."""
    code = (
        "import sys; from pathlib import Path\n"
        "from torchyard.settings import Settings\n"
        "from torchyard.broker.app import make_celery, make_consumer\n"
        "s = Settings(_env_file=None, home=Path(sys.argv[1]), broker_url=None)\n"
        "make_consumer(make_celery(s), name='w1', queue='q')\n"
        "print('made')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHONWARN")}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "home")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "made" in out.stdout
    assert "superuser" not in out.stderr and "--uid" not in out.stderr, out.stderr
