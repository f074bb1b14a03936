"""Client address resolution and normalisation (SPEC §3).

The proxy tells us the address it accepted the connection from. Only when that
address belongs to a configured trusted proxy do we look at X-Forwarded-For,
walking it from right to left exactly like nginx's ``real_ip_recursive on``.
The result is then normalised so that every spelling of one client (or of one
IPv6 /64) becomes one counting key.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass
from typing import Sequence, Union

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]


@dataclass(frozen=True, slots=True)
class ClientAddress:
    """The resolved client: the full address and the key text derived from it.

    ``address`` is None when the proxy sent nothing usable; ``key`` is then the
    empty value (SPEC §4: a missing value takes part as the empty value).
    """

    address: IPAddress | None
    key: str

    @property
    def text(self) -> str:
        """The address as a person would write it (for pages and logs)."""
        return "" if self.address is None else str(self.address)


UNKNOWN_CLIENT = ClientAddress(None, "")


def parse_address(text: str) -> IPAddress | None:
    """Parse one address; IPv4-mapped IPv6 becomes the IPv4 address."""
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    if address.version == 6:
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.scope_id is not None:
            # fe80::1%eth0 is fe80::1 as far as counting goes.
            return ipaddress.IPv6Address(int(address))
    return address


def in_networks(address: IPAddress, networks: Sequence[IPNetwork]) -> bool:
    version = address.version
    return any(version == net.version and address in net for net in networks)


class ClientIPResolver:
    """Turns (connecting peer, X-Forwarded-For) into a ClientAddress.

    Results are memoised in a bounded LRU: the same few proxies and clients
    repeat constantly, and ``ipaddress`` parsing is the slowest step here.
    """

    def __init__(
        self,
        trusted_proxies: Sequence[IPNetwork] = (),
        ipv4_prefix: int = 32,
        ipv6_prefix: int = 64,
        cache_size: int = 8192,
    ) -> None:
        self.trusted_proxies = tuple(trusted_proxies)
        self.ipv4_prefix = ipv4_prefix
        self.ipv6_prefix = ipv6_prefix
        self.resolve = functools.lru_cache(maxsize=cache_size)(self._resolve)

    def _resolve(self, peer: str, forwarded_for: str | None) -> ClientAddress:
        address = parse_address(peer) if peer else None
        if address is None:
            return UNKNOWN_CLIENT
        if forwarded_for and self.trusted_proxies and self._trusted(address):
            address = self._walk_forwarded_for(address, forwarded_for)
        return ClientAddress(address, self.key_for(address))

    def _trusted(self, address: IPAddress) -> bool:
        return in_networks(address, self.trusted_proxies)

    def _walk_forwarded_for(self, peer: IPAddress, header: str) -> IPAddress:
        """nginx ``real_ip_recursive``: the rightmost untrusted entry wins.

        A malformed entry stops the walk and the last address that parsed is
        the client; if every entry is trusted, the leftmost one is.
        """
        client = peer
        for entry in reversed(header.split(",")):
            if not entry.strip():
                continue  # "a, , b," has empty entries; nginx skips them too
            address = parse_address(entry)
            if address is None:
                return client
            client = address
            if not self._trusted(address):
                return client
        return client

    def key_for(self, address: IPAddress) -> str:
        """Canonical key text: the address, or its network when reduced."""
        prefix = self.ipv4_prefix if address.version == 4 else self.ipv6_prefix
        if prefix == address.max_prefixlen:
            return str(address)
        network_type = ipaddress.IPv4Network if address.version == 4 else ipaddress.IPv6Network
        # The constructor masks the host bits: arithmetic, never string cuts.
        return network_type((int(address), prefix), strict=False).compressed
