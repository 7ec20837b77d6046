"""Where a webhook may be sent: the public internet, unless an admin says otherwise.

An address is refused when it is in TORCHYARD_WEBHOOK_DENY_NETWORKS (always), else allowed
when it is in TORCHYARD_WEBHOOK_ALLOW_NETWORKS, else refused when it is not public
(NOT_PUBLIC: loopback, private, link-local, NAT64, 6to4, …). An IPv4-mapped IPv6 address
is judged as its IPv4 address; an IPv6 address that carries an IPv4 one (NAT64's
well-known prefix, 6to4, Teredo) must pass both as itself and as that IPv4 address, so
allowing NAT64 (an IPv6-only host's way out) never opens loopback or metadata behind it.
The API checks a literal address at create; the sender checks every resolved address
before each send (scheduler/notify.py)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from torchyard.settings import IPNetwork, Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# What is not the public internet (IANA's special-purpose registries), each with a name
# for the message.
NOT_PUBLIC: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(net), what)
    for net, what in (
        ("0.0.0.0/8", "unspecified"),
        ("10.0.0.0/8", "private"),
        ("100.64.0.0/10", "carrier-grade NAT"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("172.16.0.0/12", "private"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("192.0.2.0/24", "documentation"),
        ("192.168.0.0/16", "private"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),  # and the broadcast address
        ("::/96", "unspecified, loopback or IPv4-compatible"),
        ("64:ff9b::/96", "NAT64"),
        ("64:ff9b:1::/48", "local NAT64"),
        ("100::/64", "discard-only"),
        ("2001::/32", "Teredo"),
        ("2001:db8::/32", "documentation"),
        ("2002::/16", "6to4"),
        ("fc00::/7", "unique local"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local"),
        ("ff00::/8", "multicast"),
    )
)
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # the well-known prefix: IPv4 in the last 32 bits


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one reaches through a translator or a tunnel: NAT64's
    well-known prefix (the last 32 bits), 6to4, or a Teredo client."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip in NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    return ip.teredo[1] if ip.teredo is not None else None


@dataclass(frozen=True)
class Rule:
    deny: tuple[IPNetwork, ...]
    allow: tuple[IPNetwork, ...]

    def refusal(self, address: str) -> str | None:
        """Why `address` is no webhook's destination, as a predicate ("is not a public
        address (…)"); None when it may be one."""
        ip: IPAddress = ipaddress.ip_address(address.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        why = self._verdict(ip)
        inner = embedded_ipv4(ip)
        if why is None and inner is not None:
            why = self._verdict(inner)
            if why is not None:
                why = f"carries {inner}, which {why}"
        return why

    def _verdict(self, ip: IPAddress) -> str | None:
        net = _first(ip, self.deny)
        if net is not None:
            return f"is in a denied network ({net}, TORCHYARD_WEBHOOK_DENY_NETWORKS)"
        if _first(ip, self.allow) is not None:
            return None
        for net, what in NOT_PUBLIC:
            if ip.version == net.version and ip in net:
                return (
                    f"is not a public address ({what}, {net}; an admin may allow it with "
                    "TORCHYARD_WEBHOOK_ALLOW_NETWORKS)"
                )
        return None


def _first(ip: IPAddress, networks: tuple[IPNetwork, ...]) -> IPNetwork | None:
    return next((n for n in networks if ip.version == n.version and ip in n), None)


def rule_for(settings: Settings) -> Rule:
    return Rule(settings.webhook_denied, settings.webhook_allowed)
