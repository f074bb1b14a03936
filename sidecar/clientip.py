"""Client address resolution and normalisation.

The proxy tells us the address it accepted the connection from. Only when that
address belongs to a configured trusted proxy do we look at X-Forwarded-For,
walking it from right to left exactly like nginx's ``real_ip_recursive on``.
The result is then normalised so that every spelling of one client (or of one
IPv6 /64) becomes one counting key.

Both the peer and X-Forwarded-For come from the network, and the header can be
as long as a proxy lets a client make it (Envoy: 60 KiB, nginx: 8 KiB per
line). Nothing here is ever keyed on, copied from or proportional to the whole
header: see ``ClientIPResolver`` for the bounds.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

try:
    import cython
except ModuleNotFoundError:  # the pure-Python core without Cython installed
    from sidecar import purecython as cython  # type: ignore[no-redef]

from sidecar.bounded import SeenLately

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# How many comma-separated fields of X-Forwarded-For the trusted walk looks at,
# from the right, at most (see ClientIPResolver).
MAX_FORWARDED_HOPS = 32
# Fields (and peers) of at most this many characters are remembered between
# requests. The longest spelling of an address is 45 characters
# (0000:0000:0000:0000:0000:ffff:255.255.255.255); the rest leaves room for a
# little white space or a short zone id.
MAX_CACHED_ENTRY = 64
MAX_CACHED_HEADER = 128
_LONGEST_ADDRESS = 45
_NON_SPACE = re.compile(r"\S")
_SPACES = re.compile(r"\s*")


@cython.no_gc  # nothing it holds leads back to it
@cython.cclass
class ClientAddress:
    """The resolved client: the full address and the key text derived from it.

    ``address`` is None when the proxy sent nothing usable; ``key`` is then the
    empty value (a missing value takes part as the empty value).

    An address in canonical IPv4 text or plain IPv6 text is resolved from
    its value alone (``ClientAddress(None, key, ipv4=value)``, ``ipv6=``):
    its ``ipaddress`` object, which costs as much as the rest of resolving
    (several times as much for IPv6), is made only if something asks for
    ``address`` (a refusal's page, which shows it), so a flood of new
    addresses never makes one. Treat it as immutable.

    A client the resolver made is also told whether the ruleset's exempt
    networks hold it (``exempt_by``, the set it was looked up in, and
    ``exempt``): looked up once per address the resolver remembers, not
    once per request (``exempt_in``).

    ``text`` is the address as ``ipaddress`` writes it; a caller that has
    that text already (canonical IPv4 text is its own) passes it, and it is
    not written again. Compiled, a client is an extension type the garbage
    collector does not track.
    """

    __slots__ = ("key", "text", "numeric", "_address", "_ipv4", "_ipv6", "exempt_by", "exempt")

    def __init__(self, address: IPAddress | None, key: str, ipv4: int = -1, ipv6: int = -1,
                 text: str | None = None) -> None:
        self.key = key
        if address is None and 0 <= ipv6 <= 0xFFFFFFFF:
            # The lowest IPv6 addresses, which inet_ntop writes with a
            # dotted quad where ipaddress does not: written from the object.
            address = ipaddress.IPv6Address(ipv6)
        self._address = address
        # The address's value, when ``address`` is yet to be made.
        self._ipv4 = ipv4
        self._ipv6 = ipv6
        # The address as a person writes it, as ``ipaddress`` writes it (for
        # pages and logs): made with the client, which the resolver makes
        # once per address it remembers, without the address object.
        self.text = _text(address, ipv4, ipv6) if text is None else text
        # (IP version, the address's value), without the address object;
        # None for the unknown client.
        self.numeric: tuple[int, int] | None = \
            (4, ipv4) if ipv4 >= 0 else (6, ipv6) if ipv6 >= 0 else \
            None if address is None else (address.version, int(address))
        self.exempt_by: NetworkSet | None = None
        self.exempt = False

    @property
    def address(self) -> IPAddress | None:
        address = self._address
        if address is None:
            if self._ipv4 >= 0:
                address = self._address = ipaddress.IPv4Address(self._ipv4)
            elif self._ipv6 >= 0:
                address = self._address = ipaddress.IPv6Address(self._ipv6)
        return address

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClientAddress):
            return NotImplemented
        return self.key == other.key and self.address == other.address

    def __hash__(self) -> int:
        return hash((self.key, self.address))

    def __repr__(self) -> str:
        return f"ClientAddress({self.address!r}, {self.key!r})"

    def exempt_in(self, networks: NetworkSet) -> bool:
        """Whether ``networks`` (the exempt networks) hold the address: as
        the resolver found when it made the client for these networks, else
        looked up now."""
        if self.exempt_by is networks:
            return self.exempt
        return networks.holds(self)


def _text(address: IPAddress | None, ipv4: int, ipv6: int) -> str:
    """An address as ``ipaddress`` writes it, from its object or its value."""
    if address is not None:
        return str(address)
    if ipv4 >= 0:
        return socket.inet_ntop(socket.AF_INET, ipv4.to_bytes(4, "big"))
    if ipv6 >= 0:
        return ipv6_text(ipv6)
    return ""


def ipv6_text(value: int) -> str:
    """An IPv6 address as ``ipaddress`` writes it (RFC 5952: lower-case hex
    groups without leading zeros, the first longest run of two zero groups
    or more written "::"), from its value. Compiled, written in C into a
    scratch buffer (no Python code runs between the first byte written and
    the text made from them: no other thread can write there meanwhile),
    groups read from the value's two 64-bit halves (the pure core has
    inet_ntop write it, but for the lowest addresses, up to
    ::255.255.255.255, and IPv4-mapped ones, which inet_ntop writes with a
    dotted quad: ipaddress writes those)."""
    if not cython.compiled:
        if value <= 0xFFFF_FFFF or value >> 32 == 0xFFFF:
            return str(ipaddress.IPv6Address(value))  # inet_ntop writes these with a dotted quad
        return socket.inet_ntop(socket.AF_INET6, value.to_bytes(16, "big"))
    high = value >> 64
    low = value & _LOW64
    # The first longest run of zero groups.
    best = -1
    best_run = 1  # a run must be longer than one group
    start = -1
    for index in range(8):
        if _hextet(high, low, index):
            start = -1
        else:
            if start < 0:
                start = index
            if index + 1 - start > best_run:
                best, best_run = start, index + 1 - start
    out = _SCRATCH  # compiled: its bytes, written in C
    length = 0
    index = 0
    while index < 8:
        if index == best:
            out[length] = 58
            out[length + 1] = 58
            length += 2
            index += best_run
            continue
        if length and out[length - 1] != 58:
            out[length] = 58
            length += 1
        group = _hextet(high, low, index)
        shift = 12
        while shift and not group >> shift:
            shift -= 4  # no leading zeros
        while shift >= 0:
            out[length] = _HEX_DIGITS[group >> shift & 0xF]
            length += 1
            shift -= 4
        index += 1
    text: str = out[:length].decode("ascii")
    return text


def _hextet(high: int, low: int, index: int) -> int:
    """The ``index``-th group of 16 bits of an IPv6 address, from the left,
    of its two 64-bit halves."""
    return (high if index < 4 else low) >> (48 - 16 * (index & 3)) & 0xFFFF


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


V = TypeVar("V")

# A NetworkTable's levels: IP version -> ((mask, {network value: value}), ...).
Levels = dict[int, tuple[tuple[int, dict[int, Any]], ...]]


class NetworkTable(Generic[V]):
    """Networks, each with a value, found by an address's value.

    Grouped by IP version and prefix length, each group a dict from the
    network's integer to its value: a lookup is one mask and one dict lookup
    per prefix length in use, longest first, however many networks there
    are, and makes no ``ipaddress`` object. Of two entries for one network,
    the first is kept.
    """

    __slots__ = ("levels",)

    def __init__(self, entries: Iterable[tuple[IPNetwork, V]] = ()) -> None:
        lengths: dict[int, dict[int, dict[int, V]]] = {4: {}, 6: {}}
        for network, value in entries:
            lengths[network.version].setdefault(network.prefixlen, {}).setdefault(
                int(network.network_address), value)
        # version -> ((mask, {network value: value}), ...), longest prefix
        # first: read by a caller that looks values up on its own path
        # (sidecar.networkbans), never changed.
        self.levels = {version: tuple((_mask(version, length), values)
                                       for length, values in sorted(by_length.items(), reverse=True))
                        for version, by_length in lengths.items()}

    def values(self, version: int, value: int) -> Iterator[V]:
        """The values of the networks holding the address, longest prefix first."""
        for mask, values in self.levels[version]:
            found = values.get(value & mask)
            if found is not None:
                yield found

    def holds(self, version: int, value: int) -> bool:
        return levels_hold(self.levels, version, value)


def levels_hold(levels: Levels, version: int, value: int) -> bool:
    """Whether a network of ``levels`` holds the address of that value."""
    for mask, values in levels[version]:
        if value & mask in values:
            return True
    return False


def _mask(version: int, length: int) -> int:
    bits = 32 if version == 4 else 128
    return ((1 << bits) - 1) ^ ((1 << (bits - length)) - 1)


class NetworkSet:
    """Networks asked whether they hold a client's address: exempt
    networks, an ``ip`` condition's, an override's, a verified bot's,
    trusted proxies. A client resolved from canonical IPv4 text is looked
    up by its value, without its address object."""

    __slots__ = ("networks", "_table")

    def __init__(self, networks: Iterable[IPNetwork] = ()) -> None:
        self.networks = tuple(networks)
        self._table: NetworkTable[bool] = NetworkTable((network, True) for network in self.networks)

    def __bool__(self) -> bool:
        return bool(self.networks)

    def __len__(self) -> int:
        return len(self.networks)

    def __iter__(self) -> Iterator[IPNetwork]:
        return iter(self.networks)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NetworkSet) and self.networks == other.networks

    def __hash__(self) -> int:
        return hash(self.networks)

    def __repr__(self) -> str:
        return f"NetworkSet({[str(network) for network in self.networks]})"

    def holds(self, client: ClientAddress) -> bool:
        numeric = client.numeric
        return numeric is not None and self._table.holds(*numeric)

    def holds_value(self, version: int, value: int) -> bool:
        return self._table.holds(version, value)

    @property
    def levels(self) -> Levels:
        """Its table's levels (``NetworkTable.levels``), for a caller that
        looks values up on its own path (``levels_hold``)."""
        return self._table.levels


# Canonical dotted IPv4, the only form ``ipaddress`` accepts: four decimal
# octets of at most 255, without leading zeros.
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_CANONICAL_IPV4 = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}")


def _canonical_ipv4(text: str) -> int | None:
    """The value of ``text`` when it is an IPv4 address in canonical dotted
    form, else None, meaning "ask ``ipaddress``". The pattern decides what
    is one (inet_pton is lenient or strict depending on the C library), and
    inet_pton only turns it into bytes. Compiled, ``dotted_quad`` reads it
    in one pass of C instead."""
    if not cython.compiled:
        if _CANONICAL_IPV4.fullmatch(text) is None:
            return None
        return int.from_bytes(socket.inet_pton(socket.AF_INET, text), "big")
    value = dotted_quad(text)
    return None if value < 0 else value


def dotted_quad(text: str) -> int:
    """The value of ``text`` when it is canonical dotted IPv4 (what
    ``_CANONICAL_IPV4`` matches: four decimal octets of at most 255, without
    leading zeros, ASCII digits only), else -1: one pass over the text, no
    pattern and no bytes (tests/unit/test_clientip.py holds it to the
    pattern and to ``ipaddress``)."""
    if not 7 <= len(text) <= 15:
        return -1
    value = 0
    octet = 0
    digits = 0
    dots = 0
    for character in text:
        code = ord(character)
        if 48 <= code <= 57:
            if digits == 1 and octet == 0:
                return -1  # a leading zero
            octet = octet * 10 + code - 48
            digits += 1
            if octet > 255:
                return -1
        elif code == 46 and digits and dots < 3:
            value = value << 8 | octet
            octet = 0
            digits = 0
            dots += 1
        else:
            return -1
    if not digits or dots != 3:
        return -1
    return value << 8 | octet


# IPv6 written with hex digits and colons only: no embedded IPv4, no zone.
_PLAIN_IPV6 = re.compile(r"[0-9A-Fa-f:]{2,39}")
_LOW64 = 0xFFFF_FFFF_FFFF_FFFF  # compiled, the halves are 64-bit and wrap by themselves
# Where ipv6_text writes, compiled.
_SCRATCH = bytearray(40)
_HEX_DIGITS = b"0123456789abcdef"


def _plain_ipv6(text: str) -> int | None:
    """The value of ``text`` when it is IPv6 in hex digits and colons, else
    None, meaning "ask ``ipaddress``" (which also has the last word on what
    inet_pton refuses). For such text inet_pton and ``ipaddress`` accept
    the same strings (``tests/unit/test_clientip.py`` holds them to it).
    Compiled, ``hex_ipv6`` reads it in one pass of C instead."""
    if not cython.compiled:
        if _PLAIN_IPV6.fullmatch(text) is None:
            return None
        try:
            return int.from_bytes(socket.inet_pton(socket.AF_INET6, text), "big")
        except OSError:
            return None
    value = hex_ipv6(text)
    return None if value < 0 else value


def hex_ipv6(text: str) -> int:
    """The value of ``text`` when it is IPv6 in hex digits and colons that
    ``ipaddress`` accepts, else -1: one pass over the text, no pattern and
    no bytes (``tests/unit/test_clientip.py`` holds it to the pattern, to
    inet_pton and to ``ipaddress``). Groups of one to four hex digits go
    into a 128-bit register of two 64-bit halves; at "::" (once), the
    groups before it are put aside, and shifted over the zero groups the
    "::" stands for (at least one) when the text ends."""
    length = len(text)
    if not 2 <= length <= 39:
        return -1
    # A colon at either end is half of a "::".
    if (text[0] == ":" and text[1] != ":") or (text[length - 1] == ":" and text[length - 2] != ":"):
        return -1
    high = low = 0  # the groups since the start or the "::"
    head_high = head_low = 0  # the groups before the "::"
    head = -1  # how many there are; -1: no "::" yet
    groups = 0  # groups since the start or the "::"
    group = 0
    digits = 0
    previous = 0  # the code of the character before
    for character in text:
        code = ord(character)
        if code == 58:  # ":"
            if digits:
                high = (high << 16 | low >> 48) & _LOW64
                low = (low << 16 | group) & _LOW64
                groups += 1
                group = 0
                digits = 0
            elif previous == 58:
                if head >= 0:
                    return -1  # a second "::", or ":::"
                head, head_high, head_low = groups, high, low
                high = low = 0
                groups = 0
            # else: the first character, the first half of "::"
        else:
            if 48 <= code <= 57:
                digit = code - 48
            elif 97 <= code <= 102:
                digit = code - 87
            elif 65 <= code <= 70:
                digit = code - 55
            else:
                return -1
            if digits == 4:
                return -1
            group = group << 4 | digit
            digits += 1
        previous = code
    if digits:
        high = (high << 16 | low >> 48) & _LOW64
        low = (low << 16 | group) & _LOW64
        groups += 1
    if head < 0:
        if groups != 8:
            return -1
    elif head + groups > 7:
        return -1
    elif head:
        # The groups before "::" go to the top, over the rest's bits.
        shift = 16 * (8 - head)
        if shift >= 64:
            high |= head_low << (shift - 64) & _LOW64
        else:
            high |= (head_high << shift | head_low >> (64 - shift)) & _LOW64
            low |= head_low << shift & _LOW64
    whole = high
    return whole << 64 | low


# What one field (or the peer) is, once classified: a usable address with
# whether it is a trusted proxy, nothing but white space, or malformed.
_Entry = tuple[ClientAddress | None, bool]
_UNWALKED: Any = object()  # a header not walked yet
_BLANK: _Entry = (None, True)
_MALFORMED: _Entry = (None, False)


@cython.cclass
class ClientIPResolver:
    """Turns (connecting peer, X-Forwarded-For) into a ClientAddress.

    Without trusted proxies, or when the peer is not one, X-Forwarded-For is
    not looked at at all (not even for its length).

    With a trusted peer the header is walked from the right, one
    comma-separated field at a time, as nginx's ``real_ip_recursive on``
    does: white-space-only fields are skipped, the first untrusted address is
    the client, a field that is no address stops the walk and the last
    address that parsed (possibly the peer) is the client, and if every
    address is trusted the leftmost one is. The walk looks at no more than
    ``MAX_FORWARDED_HOPS`` (32) fields, empty ones included; past them it
    stops, and the client is the last address it accepted (a trusted one,
    or the peer): the same answer as for a header holding only its rightmost
    32 fields. (No real chain of proxies comes near 32, and a client that
    can put trusted addresses into the header can name any of them anyway.)
    Fields are found with ``rfind``; the header is never split or copied.

    Memory is bounded whatever the header sizes: the only state is a cache
    from the text of one field or peer of at most ``MAX_CACHED_ENTRY`` (64)
    characters to what it is (address, key, trusted), and one from a whole
    header of two fields or more and at most ``MAX_CACHED_HEADER`` (128)
    characters to the walk's answer (a header of one field is that field's
    entry in the first), each emptied whenever it holds ``cache_size``
    entries (at most about 400 bytes an entry: 1.6 MB each with the default
    4096). A text is stored the second time it comes lately
    (``sidecar.bounded.SeenLately``, 8 KiB): under a rotation of addresses,
    what a new client's field gave goes with its request, instead of
    filling the cache only to be dropped from it, out of the CPU's caches
    by then. A longer field is classified without being remembered and
    without copying more than 45 characters of it (the longest address; a
    zone id after ``%`` is checked in place, as counting drops it).

    ``ipaddress`` is the reference for what an address is; canonical dotted
    IPv4, the common case, and IPv6 in hex digits and colons are recognised
    without it (compiled: in one pass of C each, and an IPv6 client's text
    and key written in C). The trusted proxies are the ones the resolver is
    made with.
    """

    def __init__(
        self,
        trusted_proxies: Sequence[IPNetwork] = (),
        ipv4_prefix: int = 32,
        ipv6_prefix: int = 64,
        cache_size: int = 4096,
        exempt: NetworkSet | None = None,
    ) -> None:
        self.trusted_proxies = NetworkSet(trusted_proxies)
        # Its levels, looked up in without a call of the set for each new
        # client (compiled: in C).
        self._trusted = self.trusted_proxies.levels
        # The ruleset's exempt networks: each client made is told whether
        # they hold it (ClientAddress.exempt_in).
        self.exempt = exempt
        self.ipv4_prefix = ipv4_prefix
        self.ipv6_prefix = ipv6_prefix
        self.cache_size = cache_size
        self._cache: dict[str, _Entry] = {}
        # header -> the client its walk found, or _PEER: the connecting peer
        self._walks: dict[str, ClientAddress | None] = {}
        # What the caches were asked for lately: a text is stored the
        # second time it comes.
        self._seen = SeenLately()
        self._ipv4_mask = (0xFFFFFFFF << (32 - ipv4_prefix)) & 0xFFFFFFFF
        self._ipv6_mask = ((1 << 128) - 1) ^ ((1 << (128 - ipv6_prefix)) - 1)

    def resolve(self, peer: str, forwarded_for: str | None) -> ClientAddress:
        if not peer:
            return UNKNOWN_CLIENT
        # The peer's cache lookup is written out here: this runs for every
        # request.
        entry = self._cache.get(peer) if len(peer) <= MAX_CACHED_ENTRY else None
        if entry is None:
            entry = self._entry(peer, 0, len(peer))
        client = entry[0]
        if client is None:
            return UNKNOWN_CLIENT
        # Untrusted (always so without trusted proxies): the header is
        # not touched.
        if not entry[1] or not forwarded_for:
            return client
        end = len(forwarded_for)
        if "," not in forwarded_for:
            # One field (one proxy: the common case). The walk's answer is
            # that field's address (None: none), which the field cache
            # remembers: under a rotation of addresses, one cache entry a
            # client instead of two.
            walked = self._entry(forwarded_for, 0, end)[0]
            return client if walked is None else walked
        # The walk depends on the header alone, once the peer is trusted:
        # the same header (one client behind the same proxies) is walked once.
        walked = self._walks.get(forwarded_for, _UNWALKED) if end <= MAX_CACHED_HEADER else _UNWALKED
        if walked is _UNWALKED:
            walked = self._walk_forwarded_for(None, forwarded_for)
            if end <= MAX_CACHED_HEADER:
                self._seen.remember(self._walks, forwarded_for, walked, self.cache_size)
        return client if walked is None else walked

    def _walk_forwarded_for(self, client: ClientAddress | None, header: str) -> ClientAddress | None:
        """nginx ``real_ip_recursive``: the rightmost untrusted entry wins.

        A malformed entry stops the walk and the last address that parsed is
        the client; if every entry is trusted, the leftmost one is. At most
        MAX_FORWARDED_HOPS fields are looked at (see the class).
        """
        end = len(header)
        hops = MAX_FORWARDED_HOPS
        while True:
            start = header.rfind(",", 0, end) + 1
            entry = self._entry(header, start, end)
            if entry is not _BLANK:  # "a, , b," has empty entries; nginx skips them too
                if entry[0] is None:
                    return client
                client = entry[0]
                if not entry[1]:
                    return client
            hops -= 1
            if start == 0 or hops == 0:
                return client
            end = start - 1

    def _entry(self, text: str, start: int, end: int) -> _Entry:
        """What text[start:end] is: remembered when short, else classified
        on its own."""
        if end - start <= MAX_CACHED_ENTRY:
            field = text[start:end]
            entry = self._cache.get(field)
            if entry is None:
                entry = self._classify(field)
                self._seen.remember(self._cache, field, entry, self.cache_size)
            return entry
        return self._long_entry(text, start, end)

    def _long_entry(self, text: str, start: int, end: int) -> _Entry:
        """What a field longer than MAX_CACHED_ENTRY is, found without
        copying more than an address's worth of it, and not remembered.

        Once stripped of white space (``\\s`` is exactly what ``str.strip``
        removes), it is an address only if it is at most _LONGEST_ADDRESS
        characters, or that many followed by a zone id: ``%`` and then
        anything without ``%``, which counting drops.
        """
        first = _NON_SPACE.search(text, start, end)
        if first is None:
            return _BLANK
        begin = first.start()
        percent = text.find("%", begin, end)
        if percent < 0:
            if end - begin > _LONGEST_ADDRESS and not _SPACES.fullmatch(text, begin + _LONGEST_ADDRESS, end):
                return _MALFORMED
            return self._classify(text[begin:min(end, begin + _LONGEST_ADDRESS)])
        if (percent - begin > _LONGEST_ADDRESS or text.find("%", percent + 1, end) >= 0
                or _NON_SPACE.search(text, percent + 1, end) is None):
            return _MALFORMED
        # The zone id only has to be there: any one gives the same address.
        return self._classify(text[begin:percent] + "%z")

    def _classify(self, field: str) -> _Entry:
        """What one field (or the peer) is; a client made is told whether
        the exempt networks hold it."""
        entry = self._parse(field)
        client = entry[0]
        exempt = self.exempt
        if client is not None and exempt is not None:
            client.exempt_by = exempt
            if exempt.networks:  # none (the common case): not exempt, nothing to look up
                numeric = client.numeric
                client.exempt = numeric is not None and exempt.holds_value(*numeric)
        return entry

    def _parse(self, field: str) -> _Entry:
        text = field.strip()
        if not text:
            return _BLANK
        value = _canonical_ipv4(text)
        if value is not None:
            # Canonical text is the address's own: its key when unreduced.
            key = text if self.ipv4_prefix == 32 else self._ipv4_key(value)
            # Arguments by position: a call without keywords.
            return ClientAddress(None, key, value, -1, text), levels_hold(self._trusted, 4, value)
        value = _plain_ipv6(text)
        if value is not None:
            if value >> 32 == 0xFFFF:  # IPv4-mapped: the IPv4 address
                value &= 0xFFFFFFFF
                return ClientAddress(None, self._ipv4_key(value), value), levels_hold(self._trusted, 4, value)
            return ClientAddress(None, self._ipv6_key(value), -1, value), levels_hold(self._trusted, 6, value)
        address = parse_address(text)
        if address is None:
            return _MALFORMED
        trusted = levels_hold(self._trusted, address.version, int(address))
        return ClientAddress(address, self.key_for(address)), trusted

    def _ipv4_key(self, value: int) -> str:
        # Arithmetic on the value, never string cuts; inet_ntop writes IPv4
        # as ipaddress does.
        network = socket.inet_ntop(socket.AF_INET, (value & self._ipv4_mask).to_bytes(4, "big"))
        return network if self.ipv4_prefix == 32 else f"{network}/{self.ipv4_prefix}"

    def key_for(self, address: IPAddress) -> str:
        """Canonical key text: the address, or its network when reduced."""
        return (self._ipv4_key if address.version == 4 else self._ipv6_key)(int(address))

    def _ipv6_key(self, value: int) -> str:
        if self.ipv6_prefix == 128:
            return ipv6_text(value)
        return f"{ipv6_text(value & self._ipv6_mask)}/{self.ipv6_prefix}"
