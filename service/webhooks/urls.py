"""Where a webhook may point (SSRF): http(s) only, never the service's host, link-local or metadata."""

from __future__ import annotations

import ipaddress
import socket
from functools import lru_cache
from urllib.parse import SplitResult, urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Refused unless DPTRAIN_WEBHOOK_ALLOW_NETWORKS names them: loopback is where the API, its database and
# its broker listen; link-local holds the cloud metadata services (169.254.169.254, and AWS's
# fd00:ec2::254 on IPv6); an unspecified address connects to this host.
REFUSED: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "127.0.0.0/8",
        "::1/128",
        "169.254.0.0/16",
        "fe80::/10",
        "fd00:ec2::254/128",
        "0.0.0.0/8",
        "::/128",
    )
)


class UnsafeUrl(ValueError):
    """A webhook URL that may not be used; the message says why."""


def allowed_networks(setting: str) -> tuple[IPNetwork, ...]:
    """DPTRAIN_WEBHOOK_ALLOW_NETWORKS as networks (a bad entry raises ValueError naming it)."""
    return tuple(ipaddress.ip_network(n.strip(), strict=False) for n in setting.split(",") if n.strip())


def parse(url: str) -> SplitResult:
    """The parts of an http(s) URL with a host; UnsafeUrl otherwise."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise UnsafeUrl(f"not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise UnsafeUrl("only http and https URLs are allowed")
    if not parts.hostname:
        raise UnsafeUrl("the URL has no host")
    if parts.username is not None or parts.password is not None:
        raise UnsafeUrl("credentials in the URL are not allowed (they would be logged and listed)")
    return parts


def resolve(parts: SplitResult) -> list[IPAddress]:
    """Every address the URL's host resolves to; UnsafeUrl if it resolves to none."""
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise UnsafeUrl(f"the host {host!r} does not resolve: {exc}") from None
    found: list[IPAddress] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).partition("%")[0])
        if address not in found:
            found.append(address)
    return found


def check(addresses: list[IPAddress], *, allow: tuple[IPNetwork, ...]) -> None:
    """UnsafeUrl unless every address may be reached; all of them, as a client may use any."""
    own = own_addresses()
    for address in addresses:
        plain = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
        for candidate in (address, plain):
            if candidate is None or any(candidate in n for n in allow):
                continue
            if any(candidate in n for n in REFUSED):
                raise UnsafeUrl(
                    f"{address} is a loopback, link-local, metadata or unspecified address "
                    "(DPTRAIN_WEBHOOK_ALLOW_NETWORKS may allow it)"
                )
            if candidate in own:
                raise UnsafeUrl(
                    f"{address} is this service's own host (DPTRAIN_WEBHOOK_ALLOW_NETWORKS may allow it)"
                )


def checked(url: str, *, allow: tuple[IPNetwork, ...]) -> tuple[SplitResult, list[IPAddress]]:
    """Parse, resolve and check `url`: its parts and the addresses it may be sent to."""
    parts = parse(url)
    addresses = resolve(parts)
    check(addresses, allow=allow)
    return parts, addresses


@lru_cache(maxsize=1)
def own_addresses() -> frozenset[IPAddress]:
    """The addresses this host's name resolves to: where the API may listen besides loopback."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        return frozenset()
    return frozenset(ipaddress.ip_address(str(i[4][0]).partition("%")[0]) for i in infos)
