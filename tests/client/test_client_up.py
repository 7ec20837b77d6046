"""`torchyard up`'s pieces that need no processes: GPU detection, the admin token, the lock."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest

from torchyard.settings import Settings
from torchyard.up import Up, UpError, _port_free, detect_gpus, ensure_admin_token

SMI = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa1111-0000)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb2222-0000)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-cccc3333-0000)
"""


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, [0, 1, 2]),
        ("", []),
        ("-1", []),
        ("2,0", [2, 0]),
        ("1,7", [1]),  # a GPU that does not exist is ignored
        ("GPU-bbbb2222", [1]),  # UUID prefixes, as CUDA accepts them
        ("0,-1,2", [0]),  # CUDA stops at the first invalid entry
    ],
)
def test_detect_gpus_from_nvidia_smi_and_cuda_visible_devices(
    visible: str | None, expected: list[int]
) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert detect_gpus(env, smi=SMI) == expected


def test_no_nvidia_smi_means_no_gpu() -> None:
    assert detect_gpus({}, smi="") == []


def test_admin_token_is_private_reused_and_replaced_when_unknown(tmp_path: Path) -> None:
    from torchyard.store.migrate import upgrade

    settings = Settings(home=tmp_path)
    upgrade(settings.db_url)
    token = ensure_admin_token(settings, tmp_path)
    path = tmp_path / "admin-token"
    assert token.startswith("ty_") and path.read_text().strip() == token
    assert path.stat().st_mode & 0o777 == 0o600
    assert ensure_admin_token(settings, tmp_path) == token  # the second `up` reuses it
    path.write_text("ty_from_another_database\n")
    fresh = ensure_admin_token(settings, tmp_path)
    assert fresh != token and path.read_text().strip() == fresh


def test_one_up_per_home_and_a_busy_port_is_refused(tmp_path: Path) -> None:
    up = Up(argparse.Namespace())
    lock = up._lock(tmp_path)
    try:
        with pytest.raises(UpError, match="already running"):
            up._lock(tmp_path)
    finally:
        lock.close()
    up._lock(tmp_path).close()  # free again once the first one let go
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not _port_free("127.0.0.1", s.getsockname()[1])


def test_a_home_open_to_others_is_made_private_but_a_shared_folder_is_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchyard.up import make_private

    home, shared = tmp_path / "home", tmp_path / "shared"
    home.mkdir()
    home.chmod(0o755)
    make_private(home)
    assert home.stat().st_mode & 0o777 == 0o700 and "yours alone" in capsys.readouterr().out
    shared.mkdir()
    shared.chmod(0o1777)  # sticky, as /tmp: others' files live there too
    make_private(shared)
    assert shared.stat().st_mode & 0o7777 == 0o1777 and "warning" in capsys.readouterr().out
