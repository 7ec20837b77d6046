"""A second host on this machine: a network namespace joined to the first by a veth pair.
Processes started through `prefix()` live in it, with their own host name (UTS namespace),
reach the first host's PostgreSQL and Redis only over the veth, and can be cut off."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import uuid


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class SecondHost:
    def __init__(self, subnet: str | None = None):
        tag = uuid.uuid4().hex[:6]
        # A subnet of its own per run (inside 10.201/16, which the private PostgreSQL
        # trusts), so a run killed before its clean-up never collides with the next.
        subnet = subnet or f"10.201.{secrets.randbelow(250) + 1}"
        self.ns = f"tychaos-{tag}"
        self.root_if, self.ns_if = f"tyc0{tag}", f"tyc1{tag}"
        self.root_addr, self.addr = f"{subnet}.1", f"{subnet}.2"
        self.hostname = f"host2-{tag}"
        self.up = False

    def create(self) -> None:
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.root_if, "type", "veth", "peer", "name", self.ns_if)
        _ip("link", "set", self.ns_if, "netns", self.ns)
        _ip("addr", "add", f"{self.root_addr}/24", "dev", self.root_if)
        _ip("link", "set", self.root_if, "up")
        _ip("-n", self.ns, "addr", "add", f"{self.addr}/24", "dev", self.ns_if)
        _ip("-n", self.ns, "link", "set", self.ns_if, "up")
        _ip("-n", self.ns, "link", "set", "lo", "up")
        self.up = True

    def prefix(self) -> list[str]:
        """argv prefix that runs a command on this host (its own network and host name)."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c",
                f'hostname {self.hostname} && exec "$@"', "sh"]  # fmt: skip

    def cut(self) -> None:
        """The partition: this host's side of the link goes down (both directions lost)."""
        _ip("-n", self.ns, "link", "set", self.ns_if, "down")
        self.up = False

    def restore(self) -> None:
        _ip("-n", self.ns, "link", "set", self.ns_if, "up")
        self.up = True

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", self.root_if)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "del", self.ns)
