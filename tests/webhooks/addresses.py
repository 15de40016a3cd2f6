"""Addresses a webhook may not reach, in the forms a probe used, and a resolver that answers with them."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import pytest

# (address, what the refusal names): every IPv4-in-IPv6 form of a refused address, and the clouds'
# metadata addresses outside link-local.
REFUSED_FORMS: list[tuple[str, str]] = [
    ("::ffff:0:a9fe:a9fe", "carries 169.254.169.254"),  # SIIT's translated form
    ("::127.0.0.1", "carries 127.0.0.1"),  # IPv4-compatible
    ("::a9fe:a9fe", "carries 169.254.169.254"),
    ("64:ff9b::a9fe:a9fe", "carries 169.254.169.254"),  # NAT64, well-known prefix
    ("64:ff9b::7f00:1", "carries 127.0.0.1"),
    ("64:ff9b:1:a9fe:a9:fe00::", "carries 169.254.169.254"),  # NAT64 local-use, a /48 prefix
    ("64:ff9b:1::a9fe:a9fe", "carries 169.254.169.254"),  # NAT64 local-use, a /96 prefix
    ("2002:a9fe:a9fe::", "carries 169.254.169.254"),  # 6to4
    ("2002:7f00:1::1", "carries 127.0.0.1"),
    ("2001:0:4136:e378:8000:63bf:5601:5601", "carries 169.254.169.254"),  # Teredo (client inverted)
    ("100.100.100.200", "metadata"),  # Alibaba
    ("168.63.129.16", "metadata"),  # Azure's wire server
    ("192.0.0.192", "metadata"),  # Oracle
    ("fd20:ce::254", "metadata"),  # GCP's IPv6 metadata server
    ("::ffff:100.100.100.200", "carries 100.100.100.200"),
    ("64:ff9b::6464:64c8", "carries 100.100.100.200"),
]


def url_host(address: str) -> str:
    """`address` as the host of a URL (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address else address


def own_address() -> str:
    """An address of one of this host's interfaces that is not loopback or link-local."""
    for nic in psutil.net_if_addrs().values():
        for a in nic:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            address = ipaddress.ip_address(a.address.partition("%")[0])
            if not (address.is_loopback or address.is_link_local):
                return str(address)
    raise AssertionError(f"this host has no address besides loopback: {psutil.net_if_addrs()}")


@contextmanager
def resolving(monkeypatch: pytest.MonkeyPatch, names: dict[str, str]) -> Iterator[dict[str, str]]:
    """`socket.getaddrinfo` answers each name of `names` (changeable while in use) with its address."""
    real = socket.getaddrinfo

    def resolve(host: str, *args: Any, **kwargs: Any) -> Any:
        return real(names.get(host, host), *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(socket, "getaddrinfo", resolve)
        yield names
