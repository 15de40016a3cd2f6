"""Where a webhook may point (SSRF): http(s) only, never this host, loopback, link-local or metadata.

An IPv6 address that carries an IPv4 address (mapped, translated, compatible, NAT64, 6to4, Teredo)
may be routed to that IPv4 address by the host, a NAT64 gateway or a relay, so it is judged as the
IPv4 address too: `64:ff9b::a9fe:a9fe` is refused as 169.254.169.254 is.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
from urllib.parse import SplitResult, urlsplit

import psutil

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Refused unless DPTRAIN_WEBHOOK_ALLOW_NETWORKS names them: loopback is where the API, its database and
# its broker listen; an unspecified address connects to this host; link-local holds the cloud
# metadata services (169.254.169.254 of AWS, GCP, Azure, OCI and DigitalOcean, whose
# metadata.google.internal resolves there; ECS's 169.254.170.2); and the metadata addresses outside
# it: AWS's and GCP's IPv6 ones, Alibaba's, Azure's wire server (it hands out the VM's
# provisioning data) and Oracle's.
REFUSED: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "127.0.0.0/8",
        "::1/128",
        "0.0.0.0/8",
        "::/128",
        "169.254.0.0/16",
        "fe80::/10",
        "fd00:ec2::254/128",
        "fd20:ce::254/128",
        "100.100.100.200/32",
        "168.63.129.16/32",
        "192.0.0.192/32",
    )
)

# IPv6 ranges whose last 32 bits are an IPv4 address: SIIT's translated form ::ffff:0:a.b.c.d
# (RFC 2765), the deprecated IPv4-compatible ::a.b.c.d, NAT64's well-known prefix (RFC 6052).
# ipaddress knows only the mapped form (`ipv4_mapped`), 6to4 (`sixtofour`) and Teredo (`teredo`).
_LAST_32_BITS = tuple(ipaddress.IPv6Network(n) for n in ("::ffff:0:0:0/96", "::/96", "64:ff9b::/96"))
# NAT64's local-use prefix (RFC 8215): the operator picks a prefix of /48 to /96 inside it, and the
# IPv4 address sits where RFC 6052 puts it for that length. Which length is not known here, so every
# placement the address fits (RFC 6052's zero octet and zero suffix) is read.
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")
_NAT64_LOCAL_LENGTHS = (48, 56, 64)

# How long the list of this host's addresses is reused: interfaces change rarely (DHCP, a VPN).
_OWN_TTL_SECONDS = 30.0


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
        address = _address(str(info[4][0]))
        if address not in found:
            found.append(address)
    return found


def embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses that `address` carries in any IPv4-in-IPv6 form (none for a plain one)."""
    found: list[ipaddress.IPv4Address] = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        # (server, client): the client's address, un-inverted by ipaddress, is where a relay sends.
        found.extend(address.teredo)
    if any(address in n for n in _LAST_32_BITS):
        found.append(ipaddress.IPv4Address(address.packed[12:]))
    if address in _NAT64_LOCAL:
        found.extend(_nat64_local(address.packed))
    return found


def _nat64_local(packed: bytes) -> list[ipaddress.IPv4Address]:
    # RFC 6052 section 2.2: under a /48, /56 or /64 prefix the IPv4 address starts right after the
    # prefix, skips byte 8 (always zero) and is followed by a zero suffix; under a /96 it is the last
    # 32 bits. Every reading must pass: a translator with a /48 prefix thus reaches nothing unless
    # the setting allows it (its addresses read as 0.0.0.0 under /96), the price of not knowing.
    found = []
    for length in _NAT64_LOCAL_LENGTHS:
        suffix = 5 + length // 8
        if packed[8] == 0 and not any(packed[suffix:]):
            found.append(ipaddress.IPv4Address(packed[length // 8 : 8] + packed[9:suffix]))
    return [*found, ipaddress.IPv4Address(packed[12:])]


def check(addresses: list[IPAddress], *, allow: tuple[IPNetwork, ...]) -> None:
    """UnsafeUrl unless every address may be reached; all of them, as a client may use any."""
    own = own_addresses()
    for address in addresses:
        if _within(address, allow):
            continue
        carried = embedded_ipv4(address) if isinstance(address, ipaddress.IPv6Address) else []
        # The address itself and each IPv4 address it carries must pass on its own.
        for candidate in (address, *carried):
            if candidate is not address and _within(candidate, allow):
                continue
            what = str(address) if candidate is address else f"{address} (which carries {candidate})"
            if _within(candidate, REFUSED):
                raise UnsafeUrl(
                    f"{what} is a loopback, link-local, metadata or unspecified address "
                    "(DPTRAIN_WEBHOOK_ALLOW_NETWORKS may allow it)"
                )
            if candidate in own:
                raise UnsafeUrl(
                    f"{what} is this service's own host (DPTRAIN_WEBHOOK_ALLOW_NETWORKS may allow it)"
                )


def checked(url: str, *, allow: tuple[IPNetwork, ...]) -> tuple[SplitResult, list[IPAddress]]:
    """Parse, resolve and check `url`: its parts and the addresses it may be sent to."""
    parts = parse(url)
    addresses = resolve(parts)
    check(addresses, allow=allow)
    return parts, addresses


_own_lock = threading.Lock()
_own: tuple[float, frozenset[IPAddress]] | None = None


def own_addresses() -> frozenset[IPAddress]:
    """Every address of this host: those of all its interfaces, and those its name resolves to."""
    global _own
    with _own_lock:
        if _own is not None and time.monotonic() - _own[0] < _OWN_TTL_SECONDS:
            return _own[1]
        # psutil (getifaddrs) lists every address of every interface, secondary ones included,
        # where the host name may resolve to one of them or only to loopback (as in /etc/hosts).
        found = {
            _address(a.address)
            for nic in psutil.net_if_addrs().values()
            for a in nic
            if a.family in (socket.AF_INET, socket.AF_INET6)
        }
        # An address the name resolves to but no interface holds (a NAT's) still leads here.
        with contextlib.suppress(OSError):
            found.update(_address(str(i[4][0])) for i in socket.getaddrinfo(socket.gethostname(), None))
        _own = (time.monotonic(), frozenset(found))
        return _own[1]


def _address(text: str) -> IPAddress:
    # A scoped IPv6 address (fe80::1%eth0) without its zone.
    return ipaddress.ip_address(text.partition("%")[0])


def _within(address: IPAddress, networks: tuple[IPNetwork, ...]) -> bool:
    return any(address in n for n in networks)
