"""Bans an administrator issues, of one client or of a whole network.

A client is banned by its counting key, the text the resolver makes of its
address (``ClientIPResolver.key_for``: an IPv6 address by its /64 unless
``client_ip.ipv6_prefix`` says otherwise): that ban is a ban record like
the one a rule issues, checked by the store with the rest of the request.
A network wider or narrower than one client key is a network ban:
``NetworkBans`` holds them in the process, and the engine looks the
client's full address up in it before anything else (exempt addresses
aside). With a shared store the network bans live there and each node
keeps a copy (``sidecar.store.redis_admin``).
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable
from dataclasses import dataclass

from sidecar.clientip import ClientAddress, ClientIPResolver, IPAddress, IPNetwork, NetworkTable, parse_address
from sidecar.state import BanRecord

# Longer texts are no address or network: refused before they are parsed.
MAX_ADDRESS_CHARS = 100


def client_key(resolver: ClientIPResolver, text: str) -> str:
    """The counting key of the client ``text`` names: an address, or a
    network of exactly the width one key covers (``2001:db8::/64``).
    ValueError says why ``text`` is neither."""
    target = ban_target(resolver, text)
    if target.network is not None:
        prefix = resolver.ipv4_prefix if target.network.version == 4 else resolver.ipv6_prefix
        raise ValueError(f"{text!r} is a network; one client is an address, or a /{prefix} "
                         f"(client_ip.ipv{target.network.version}_prefix)")
    return target.text


@dataclass(frozen=True, slots=True)
class BanTarget:
    """What a ban names: one client key (``network`` None), or a network."""

    text: str  # the client key, or the network in its canonical form
    network: IPNetwork | None = None


def ban_target(resolver: ClientIPResolver, text: str) -> BanTarget:
    """``203.0.113.7``, ``2001:db8::1`` (its /64), ``198.51.100.0/24``: a
    network as wide as one client key is that key; ValueError says what is
    wrong with anything else."""
    text = text.strip()
    if not text or len(text) > MAX_ADDRESS_CHARS:
        raise ValueError(f"expected an IP address or a network (CIDR), got {text[:MAX_ADDRESS_CHARS]!r}")
    address = parse_address(text)
    if address is not None:
        return BanTarget(resolver.key_for(address))
    try:
        network = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise ValueError(f"expected an IP address or a network (CIDR), got {text!r}") from None
    try:
        ipaddress.ip_network(text)
    except ValueError:
        raise ValueError(f"{text!r} has bits set after its /{network.prefixlen}: did you mean {network}?") \
            from None
    if network.prefixlen == 0:
        raise ValueError(f"{text!r} is every address: refused")
    if isinstance(network, ipaddress.IPv6Network) and network.network_address.ipv4_mapped is not None:
        raise ValueError(f"{text!r}: IPv4-mapped addresses count as IPv4; ban the IPv4 network")
    prefix = resolver.ipv4_prefix if network.version == 4 else resolver.ipv6_prefix
    if network.prefixlen == prefix:
        return BanTarget(resolver.key_for(network.network_address))
    return BanTarget(str(network), network)


class NetworkBans:
    """The network bans in force, looked up for every request's address
    (``clientip.NetworkTable``: one mask and one dict lookup per prefix
    length in use, however many networks are banned)."""

    def __init__(self) -> None:
        self._records: dict[str, tuple[IPNetwork, BanRecord]] = {}
        self._table: NetworkTable[BanRecord] = NetworkTable()
        self._last_end = -math.inf  # after it, nothing is banned
        # Whether any network is banned (in force or ended but not yet
        # dropped): read by the engine before it asks, as no ban is nearly
        # always the case and an attribute costs less than a call.
        self.banning = False

    def __bool__(self) -> bool:
        return bool(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def find(self, address: IPAddress, now: float) -> BanRecord | None:
        """The ban in force whose network holds ``address``, if any."""
        return self._find(address.version, int(address), now)

    def find_client(self, client: ClientAddress, now: float) -> BanRecord | None:
        """``find`` for a request's client, without its address object:
        at once when no network is banned (nearly every request)."""
        if not self.banning:
            return None
        numeric = client.numeric
        return self._find(*numeric, now) if numeric is not None else None

    def _find(self, version: int, value: int, now: float) -> BanRecord | None:
        if now >= self._last_end:
            if self._records:
                self.replace([])  # every ban ended: requests stop looking
            return None
        # NetworkTable.values, written out: a check's lookup stays in this module.
        for mask, bans in self._table.levels[version]:
            ban = bans.get(value & mask)
            if ban is not None and now < ban.expires:
                return ban
        return None

    def in_force(self, now: float) -> list[BanRecord]:
        return sorted((ban for _, ban in self._records.values() if now < ban.expires),
                      key=lambda ban: ban.address)

    def add(self, ban: BanRecord) -> None:
        """Ban ``ban.address``, a network in canonical form (replacing its ban)."""
        self._records[ban.address] = (ipaddress.ip_network(ban.address), ban)
        self._rebuild()

    def remove(self, network: str) -> bool:
        found = self._records.pop(network, None) is not None
        if found:
            self._rebuild()
        return found

    def replace(self, bans: Iterable[BanRecord]) -> None:
        """Hold exactly ``bans`` (a shared store's, read again)."""
        self._records = {ban.address: (ipaddress.ip_network(ban.address), ban) for ban in bans}
        self._rebuild()

    def _rebuild(self) -> None:
        self._table = NetworkTable(self._records.values())
        self._last_end = max((ban.expires for _, ban in self._records.values()), default=-math.inf)
        self.banning = bool(self._records)
