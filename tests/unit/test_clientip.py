"""Client address resolution and normalisation."""

from __future__ import annotations

import gc
import ipaddress
import socket
import tracemalloc
from ipaddress import IPv4Address, IPv6Address, ip_network

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from sidecar.clientip import (
    _PLAIN_IPV6,
    MAX_CACHED_ENTRY,
    MAX_FORWARDED_HOPS,
    ClientAddress,
    ClientIPResolver,
    NetworkSet,
    NetworkTable,
    _canonical_ipv4,
    _plain_ipv6,
    dotted_quad,
    hex_ipv6,
    ipv6_text,
)

# --------------------------------------------------------------------------
# Strategies: addresses and every legal way of writing them
# --------------------------------------------------------------------------

ipv4_ints = st.integers(min_value=0, max_value=2**32 - 1)
ipv6_ints = st.integers(min_value=0, max_value=2**128 - 1)


def _is_mapped(value: int) -> bool:
    return IPv6Address(value).ipv4_mapped is not None


# Addresses that stay IPv6 after normalisation (not ::ffff:a.b.c.d).
plain_ipv6_ints = ipv6_ints.filter(lambda value: not _is_mapped(value))


@st.composite
def ipv6_spellings(draw: st.DrawFn, value: int) -> str:
    """One textual spelling of ``value``, as RFC 4291 §2.2 allows writing it.

    Per group: any number of leading zeros up to four digits and any letter
    case; optionally one run of zero groups replaced by ``::``; optionally the
    last 32 bits as a dotted quad.
    """
    groups = [(value >> (16 * (7 - index))) & 0xFFFF for index in range(8)]
    dotted_tail = draw(st.booleans())
    hex_count = 6 if dotted_tail else 8

    texts = []
    for group in groups[:hex_count]:
        digits = format(group, "x")
        width = draw(st.integers(min_value=len(digits), max_value=4))
        padded = digits.rjust(width, "0")
        texts.append("".join(draw(st.sampled_from([c.lower(), c.upper()])) for c in padded))

    zero_runs = [(start, end)
                 for start in range(hex_count)
                 for end in range(start + 1, hex_count + 1)
                 if all(group == 0 for group in groups[start:end])]
    run = draw(st.none() | st.sampled_from(zero_runs)) if zero_runs else None

    tail = [str(IPv4Address(value & 0xFFFFFFFF))] if dotted_tail else []
    if run is None:
        return ":".join(texts + tail)
    start, end = run
    left = ":".join(texts[:start])
    right = ":".join(texts[end:] + tail)
    return f"{left}::{right}"


@st.composite
def one_address_two_spellings(draw: st.DrawFn) -> tuple[int, str, str]:
    value = draw(ipv6_ints)
    return value, draw(ipv6_spellings(value)), draw(ipv6_spellings(value))


def resolve(peer: str, forwarded_for: str | None = None, **options) -> ClientAddress:
    return ClientIPResolver(**options).resolve(peer, forwarded_for)


def expected_v6_key(value: int, prefix: int = 64) -> str:
    network = ipaddress.IPv6Network((value, prefix), strict=False)
    return f"{network.network_address.compressed}/{prefix}"


# --------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------


@given(one_address_two_spellings())
def test_every_spelling_of_one_ipv6_address_gives_the_same_key(case: tuple[int, str, str]) -> None:
    value, first, second = case
    assert ipaddress.ip_address(first) == ipaddress.ip_address(second) == IPv6Address(value)
    a, b = resolve(first), resolve(second)
    assert a.key == b.key != ""
    assert a.address == b.address


@pytest.mark.parametrize("spelling", [
    "2001:db8:1:2::5",
    "2001:DB8:1:2::5",
    "2001:0db8:0001:0002:0000:0000:0000:0005",
    "2001:0DB8:0001:0002:0000:0000:0000:0005",
    "2001:db8:1:2:0:0:0:5",
    "2001:db8:1:2:0::5",
    "2001:db8:1:2::0.0.0.5",
    " 2001:db8:1:2::5 ",
])
def test_ipv6_key_is_the_slash_64_in_canonical_compressed_form(spelling: str) -> None:
    assert resolve(spelling).key == "2001:db8:1:2::/64"


@given(plain_ipv6_ints, st.integers(min_value=0, max_value=2**64 - 1))
def test_all_addresses_in_one_slash_64_share_one_key(value: int, other_host_bits: int) -> None:
    neighbour = (value >> 64 << 64) | other_host_bits
    assume(not _is_mapped(neighbour))
    a, b = resolve(str(IPv6Address(value))), resolve(str(IPv6Address(neighbour)))
    assert a.key == b.key == expected_v6_key(value)


@given(st.integers(0, 2**64 - 1), st.integers(1, 2**64 - 1),
       st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_addresses_in_different_slash_64s_get_different_keys(
        network: int, difference: int, host: int, other_host: int) -> None:
    first = network << 64 | host
    second = (network ^ difference) << 64 | other_host
    assume(not _is_mapped(first) and not _is_mapped(second))
    assert resolve(str(IPv6Address(first))).key != resolve(str(IPv6Address(second))).key


@given(plain_ipv6_ints, st.integers(min_value=1, max_value=127))
def test_ipv6_prefix_is_applied_with_a_bit_mask(value: int, prefix: int) -> None:
    spelling = IPv6Address(value).exploded  # exploded: string truncation would go wrong
    assert resolve(spelling, ipv6_prefix=prefix).key == expected_v6_key(value, prefix)


@given(plain_ipv6_ints)
def test_ipv6_prefix_128_keys_the_whole_address(value: int) -> None:
    assert resolve(IPv6Address(value).exploded.upper(), ipv6_prefix=128).key == IPv6Address(value).compressed


@given(ipv4_ints)
def test_ipv4_mapped_ipv6_gives_the_same_client_as_plain_ipv4(value: int) -> None:
    dotted = str(IPv4Address(value))
    plain = resolve(dotted)
    assert plain == ClientAddress(IPv4Address(value), dotted)
    for mapped in (f"::ffff:{dotted}", f"::FFFF:{dotted}", f"0:0:0:0:0:ffff:{dotted}",
                   f"::ffff:{value >> 16:x}:{value & 0xFFFF:x}",
                   f"0000:0000:0000:0000:0000:FFFF:{value >> 16:04X}:{value & 0xFFFF:04X}"):
        assert resolve(mapped) == plain, mapped


@given(ipv4_ints)
def test_ipv4_mapped_ipv6_uses_the_ipv4_prefix_not_the_ipv6_one(value: int) -> None:
    dotted = str(IPv4Address(value))
    key = resolve(f"::ffff:{dotted}", ipv4_prefix=24, ipv6_prefix=64).key
    assert key == f"{IPv4Address(value >> 8 << 8)}/24"


@given(ipv4_ints, st.integers(min_value=0, max_value=255))
def test_ipv4_prefix_24_groups_a_slash_24(value: int, last_octet: int) -> None:
    neighbour = (value >> 8 << 8) | last_octet
    a = resolve(str(IPv4Address(value)), ipv4_prefix=24)
    b = resolve(str(IPv4Address(neighbour)), ipv4_prefix=24)
    assert a.key == b.key == f"{IPv4Address(value >> 8 << 8)}/24"
    assert a.address == IPv4Address(value)  # the full address is kept for logs and pages


@given(ipv4_ints, ipv4_ints)
def test_ipv4_prefix_24_separates_different_slash_24s(first: int, second: int) -> None:
    assume(first >> 8 != second >> 8)
    a = resolve(str(IPv4Address(first)), ipv4_prefix=24)
    b = resolve(str(IPv4Address(second)), ipv4_prefix=24)
    assert a.key != b.key


@given(ipv4_ints)
def test_default_ipv4_key_is_the_address_itself(value: int) -> None:
    assert resolve(str(IPv4Address(value))).key == str(IPv4Address(value))


@pytest.mark.parametrize("peer", ["", "junk", "256.1.1.1", "1.2.3", "2001:db8::1::2", "1.2.3.4:80",
                                  "[2001:db8::1]", "::ffff:1.2.3"])
def test_missing_or_invalid_address_is_the_empty_key(peer: str) -> None:
    assert resolve(peer) == ClientAddress(None, "")


def test_invalid_peer_never_takes_the_address_from_forwarded_for() -> None:
    resolver = ClientIPResolver([ip_network("0.0.0.0/0"), ip_network("::/0")])
    assert resolver.resolve("junk", "203.0.113.5") == ClientAddress(None, "")


# --------------------------------------------------------------------------
# Trusted proxies: nginx real_ip_recursive
# --------------------------------------------------------------------------

TRUSTED = [ip_network("127.0.0.0/8"), ip_network("10.0.0.0/8"), ip_network("2001:db8:ffff::/48")]

trusted_v4 = st.integers(0, 2**24 - 1).map(lambda low: str(IPv4Address((10 << 24) | low)))
# 198.18.0.0/15: never inside TRUSTED.
untrusted_v4 = st.integers(0, 2**17 - 1).map(lambda low: str(IPv4Address((198 << 24) | (18 << 16) | low)))
untrusted_v6 = st.integers(0, 2**80 - 1).map(lambda low: str(IPv6Address((0x2001_0db8_0001 << 80) | low)))
trusted_entry = trusted_v4 | st.just("127.0.0.1")
untrusted_entry = untrusted_v4 | untrusted_v6


def _key(text: str) -> str:
    return ClientIPResolver().resolve(text, None).key


def test_trusted_peer_takes_the_client_from_forwarded_for() -> None:
    resolver = ClientIPResolver(TRUSTED)
    assert resolver.resolve("127.0.0.1", "203.0.113.30") == ClientAddress(IPv4Address("203.0.113.30"),
                                                                          "203.0.113.30")


def test_trusted_peer_without_forwarded_for_is_the_client() -> None:
    resolver = ClientIPResolver(TRUSTED)
    assert resolver.resolve("127.0.0.1", None).key == "127.0.0.1"
    assert resolver.resolve("127.0.0.1", "").key == "127.0.0.1"


def test_rightmost_untrusted_entry_is_the_client() -> None:
    resolver = ClientIPResolver(TRUSTED)
    assert resolver.resolve("127.0.0.1", "198.51.100.7, 203.0.113.30, 10.1.1.1").key == "203.0.113.30"


def test_every_entry_trusted_gives_the_leftmost_entry() -> None:
    resolver = ClientIPResolver(TRUSTED)
    assert resolver.resolve("127.0.0.1", "10.0.0.5, 10.0.0.6").key == "10.0.0.5"


def test_malformed_entry_stops_the_walk_at_the_last_parsed_address() -> None:
    # The walk's example: the junk is examined first and does not parse, so
    # the last address examined and parsed is the peer itself.
    resolver = ClientIPResolver(TRUSTED)
    assert resolver.resolve("127.0.0.1", "203.0.113.30, junk").key == "127.0.0.1"


def test_malformed_entry_after_trusted_entries_gives_the_last_trusted_entry() -> None:
    resolver = ClientIPResolver(TRUSTED)
    assert resolver.resolve("127.0.0.1", "203.0.113.30, junk, 10.0.0.2").key == "10.0.0.2"


def test_forwarded_for_entries_are_normalised_like_the_peer() -> None:
    resolver = ClientIPResolver(TRUSTED)
    assert resolver.resolve("127.0.0.1", "::FFFF:203.0.113.30").key == "203.0.113.30"
    assert resolver.resolve("127.0.0.1", "2001:DB8:1:2:0:0:0:9").key == "2001:db8:1:2::/64"
    assert resolver.resolve("::ffff:127.0.0.1", "203.0.113.30").key == "203.0.113.30"


@given(st.lists(st.one_of(untrusted_entry, trusted_entry), max_size=4),
       untrusted_entry,
       st.lists(trusted_entry, max_size=4))
def test_trusted_walk_skips_trusted_entries_from_the_right(
        before: list[str], client: str, trusted_after: list[str]) -> None:
    header = ", ".join(before + [client] + trusted_after)
    resolved = ClientIPResolver(TRUSTED).resolve("127.0.0.1", header)
    assert resolved.address == ipaddress.ip_address(client)
    assert resolved.key == _key(client)


@given(st.lists(trusted_entry, min_size=1, max_size=6))
def test_trusted_walk_with_only_trusted_entries_gives_the_leftmost(entries: list[str]) -> None:
    resolved = ClientIPResolver(TRUSTED).resolve("10.9.9.9", ",".join(entries))
    assert resolved.key == _key(entries[0])


@given(untrusted_entry, st.text())
def test_untrusted_peer_ignores_forwarded_for_entirely(peer: str, forwarded_for: str) -> None:
    resolver = ClientIPResolver(TRUSTED)
    assert resolver.resolve(peer, forwarded_for) == resolver.resolve(peer, None) == \
        ClientIPResolver().resolve(peer, None)


@given(untrusted_entry, st.lists(untrusted_entry | trusted_entry, min_size=1, max_size=4))
def test_spoofed_forwarded_for_from_an_untrusted_peer_gives_no_new_key(peer: str, spoofed: list[str]) -> None:
    resolver = ClientIPResolver(TRUSTED)
    assert resolver.resolve(peer, ", ".join(spoofed)).key == _key(peer)


@given(untrusted_entry | trusted_entry, st.text())
def test_empty_trusted_list_never_reads_forwarded_for(peer: str, forwarded_for: str) -> None:
    resolver = ClientIPResolver([])
    assert resolver.resolve(peer, forwarded_for) == resolver.resolve(peer, None)
    assert resolver.resolve(peer, forwarded_for).key == _key(peer)


# --------------------------------------------------------------------------
# Bounds (D3): X-Forwarded-For of any size costs bounded memory and work
# --------------------------------------------------------------------------

# The reference: what the resolver must answer, written with ipaddress only
# and the obvious split of the header, capped at the rightmost
# MAX_FORWARDED_HOPS fields as documented.


def _reference_parse(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    if isinstance(address, IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.scope_id is not None:
            return IPv6Address(int(address))
    return address


def _reference_resolve(trusted: list, peer: str, forwarded_for: str | None,
                       ipv4_prefix: int = 32, ipv6_prefix: int = 64) -> ClientAddress:
    def is_trusted(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return any(address.version == net.version and address in net for net in trusted)

    address = _reference_parse(peer) if peer else None
    if address is None:
        return ClientAddress(None, "")
    if forwarded_for and trusted and is_trusted(address):
        for entry in reversed(forwarded_for.split(",")[-MAX_FORWARDED_HOPS:]):
            if not entry.strip():
                continue
            parsed = _reference_parse(entry)
            if parsed is None:
                break
            address = parsed
            if not is_trusted(parsed):
                break
    prefix = ipv4_prefix if address.version == 4 else ipv6_prefix
    if prefix == address.max_prefixlen:
        return ClientAddress(address, str(address))
    network_type = ipaddress.IPv4Network if address.version == 4 else ipaddress.IPv6Network
    return ClientAddress(address, network_type((int(address), prefix), strict=False).compressed)


white_space = st.text(alphabet=" \t\xa0\u2003", max_size=3)
long_white_space = st.integers(60, 300).map(lambda n: " " * n)
near_ipv4 = st.text(alphabet="0123456789.", min_size=1, max_size=16)
# Text that may or may not be an address, IPv4 or IPv6.
junk = st.text(alphabet=" \t.:%0123456789abcdefABCDEFx\u0661\xb2", max_size=24)
zoned = st.tuples(st.sampled_from(["fe80::1", "2001:db8:ffff::9", "::ffff:10.0.0.1", "junk"]),
                  st.text(alphabet="abcdefgh0123456789", min_size=1, max_size=120)
                  ).map(lambda parts: f"{parts[0]}%{parts[1]}")
spelled_address = st.one_of(
    trusted_entry, untrusted_entry,
    trusted_v4.map(lambda text: f"::ffff:{text}"), trusted_v4.map(lambda text: f"::FFFF:{text}"),
    st.just("2001:db8:ffff::5"), st.just("2001:DB8:FFFF:0:0:0:0:5"),
)
forwarded_field = st.one_of(
    spelled_address,
    st.tuples(white_space, spelled_address, white_space).map("".join),
    st.tuples(long_white_space, spelled_address, long_white_space).map("".join),
    st.tuples(long_white_space, spelled_address | zoned).map("".join),
    st.tuples(spelled_address | zoned, long_white_space).map("".join),
    st.just(""), white_space, long_white_space,
    near_ipv4, junk, zoned,
    st.integers(65, 400).map(lambda n: "1" * n),
)
forwarded_header = st.lists(forwarded_field, max_size=MAX_FORWARDED_HOPS + 8).map(",".join)
peers = st.one_of(spelled_address, st.tuples(white_space, spelled_address, white_space).map("".join),
                  st.tuples(long_white_space, trusted_entry, long_white_space).map("".join),
                  near_ipv4, junk, zoned, st.just(""))
TRUST_SETS = {
    "none": [],
    "some": TRUSTED,
    "everything": [ip_network("0.0.0.0/0"), ip_network("::/0")],
}
# One resolver per case for the whole run, with a cache small enough to be
# emptied now and then: cached and fresh answers are both compared.
_RESOLVERS = {(name, v4, v6): ClientIPResolver(trusted, v4, v6, cache_size=16)
              for name, trusted in TRUST_SETS.items() for v4, v6 in ((32, 64), (24, 48), (32, 128))}


@given(st.sampled_from(sorted(_RESOLVERS)), peers, st.none() | forwarded_header)
def test_resolve_agrees_with_the_ipaddress_reference(case: tuple[str, int, int], peer: str,
                                                     forwarded_for: str | None) -> None:
    name, v4, v6 = case
    resolver = _RESOLVERS[case]
    expected = _reference_resolve(TRUST_SETS[name], peer, forwarded_for, v4, v6)
    assert resolver.resolve(peer, forwarded_for) == expected
    assert resolver.resolve(peer, forwarded_for) == expected  # now from the cache


@given(st.one_of(near_ipv4, st.tuples(white_space, near_ipv4, white_space).map("".join),
                 ipv4_ints.map(lambda value: str(IPv4Address(value))),
                 st.text(max_size=16)),
       st.sampled_from([32, 24, 1]))
def test_the_fast_ipv4_path_agrees_with_ipaddress(text: str, ipv4_prefix: int) -> None:
    expected = _reference_resolve([], text, None, ipv4_prefix)
    assert ClientIPResolver(ipv4_prefix=ipv4_prefix).resolve(text, None) == expected


@pytest.mark.parametrize("text", ["01.2.3.4", "1.2.3.04", "00.0.0.0", "0.0.0.0", "255.255.255.255",
                                  "256.0.0.0", "1.2.3", "1.2.3.4.5", "1..2.3", "1.2.3.4.",
                                  "\u0661.\u0662.\u0663.\u0664", "1.2.3.\xb2", "1.2.3.4\x00", "\ud800",
                                  "0x1.2.3.4", "1.2.3.4/32", " 1.2.3.4\t", "1.2.3.4:80", "+1.2.3.4"])
def test_ipv4_edge_spellings_agree_with_ipaddress(text: str) -> None:
    resolver = ClientIPResolver(TRUSTED)
    assert resolver.resolve(text, None) == _reference_resolve(TRUSTED, text, None)
    assert resolver.resolve("127.0.0.1", text) == _reference_resolve(TRUSTED, "127.0.0.1", text)


@given(st.one_of(near_ipv4, ipv4_ints.map(lambda value: str(IPv4Address(value))), st.text(max_size=16),
                 st.sampled_from(["01.2.3.4", "1.2.3.04", "0.0.0.0", "255.255.255.255", "256.0.0.0", "1.2.3.4.",
                                  ".1.2.3.4", "1.2.3.1000", "9.9.9.9\n", "\u0661.\u0662.\u0663.\u0664"])))
def test_canonical_ipv4_is_read_as_the_pattern_and_ipaddress_read_it(text: str) -> None:
    """The compiled core reads canonical IPv4 in one pass (dotted_quad),
    the pure one with the pattern: each agrees with ipaddress, and the
    client resolved from it is written as ipaddress writes it."""
    try:
        expected = int(IPv4Address(text))
    except ValueError:
        expected = -1
    assert dotted_quad(text) == expected
    assert _canonical_ipv4(text) == (None if expected < 0 else expected)
    client = ClientIPResolver().resolve(text, None)
    if expected >= 0:
        assert (client.key, client.text, client.numeric) == (text, str(IPv4Address(expected)), (4, expected))


class Untouchable:
    """A header that must not be looked at: every use of it fails the test."""

    def _touched(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("X-Forwarded-For was read")

    __bool__ = __len__ = __str__ = __hash__ = __eq__ = __getitem__ = __iter__ = _touched
    __getattr__ = _touched  # split, rfind, strip, ...


@pytest.mark.parametrize("peer", ["127.0.0.1", "10.0.0.1", "198.51.100.7", "2001:db8::1", "junk", ""])
def test_without_trusted_proxies_forwarded_for_is_never_read(peer: str) -> None:
    resolver = ClientIPResolver([])
    assert resolver.resolve(peer, Untouchable()) == resolver.resolve(peer, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("peer", ["198.51.100.7", "::ffff:198.51.100.7", "2001:db8:1::1", "junk", ""])
def test_forwarded_for_from_an_untrusted_peer_is_never_read(peer: str) -> None:
    resolver = ClientIPResolver(TRUSTED)
    assert resolver.resolve(peer, Untouchable()) == resolver.resolve(peer, None)  # type: ignore[arg-type]


def _trusted_chain(count: int) -> list[str]:
    return [f"10.0.{index // 250}.{index % 250 + 1}" for index in range(count)]


def test_the_walk_stops_after_max_forwarded_hops_fields() -> None:
    resolver = ClientIPResolver(TRUSTED)
    chain = _trusted_chain(MAX_FORWARDED_HOPS + 8)
    header = ", ".join(["198.51.100.1"] + chain)
    # The 32nd field from the right, a trusted one, as though the header
    # held only its last 32 fields; the untrusted client further left is
    # never reached.
    assert resolver.resolve("127.0.0.1", header).key == chain[-MAX_FORWARDED_HOPS]
    assert resolver.resolve("127.0.0.1", header) == _reference_resolve(TRUSTED, "127.0.0.1", header)


def test_a_client_exactly_max_forwarded_hops_fields_from_the_right_is_found() -> None:
    resolver = ClientIPResolver(TRUSTED)
    header = ", ".join(["198.51.100.1"] + _trusted_chain(MAX_FORWARDED_HOPS - 1))
    assert resolver.resolve("127.0.0.1", header).key == "198.51.100.1"


def test_empty_fields_count_towards_max_forwarded_hops() -> None:
    resolver = ClientIPResolver(TRUSTED)
    assert resolver.resolve("127.0.0.1", "198.51.100.1" + "," * (MAX_FORWARDED_HOPS - 1)).key == "198.51.100.1"
    assert resolver.resolve("127.0.0.1", "198.51.100.1" + "," * MAX_FORWARDED_HOPS).key == "127.0.0.1"
    assert resolver.resolve("127.0.0.1", "198.51.100.1" + ", " * 30_000).key == "127.0.0.1"


class WatchedHeader(str):
    """A header that records how it is used."""

    def __new__(cls, text: str) -> WatchedHeader:
        header = super().__new__(cls, text)
        header.searches = 0
        header.longest_copy = 0
        return header

    def rfind(self, *args: object) -> int:  # type: ignore[override]
        self.searches += 1
        return super().rfind(*args)  # type: ignore[arg-type]

    def __getitem__(self, index: object) -> str:  # type: ignore[override]
        part = super().__getitem__(index)  # type: ignore[index]
        self.longest_copy = max(self.longest_copy, len(part))
        return part

    def split(self, *args: object, **kwargs: object) -> list[str]:  # type: ignore[override]
        raise AssertionError("the header was split")


@pytest.mark.parametrize("header", [
    "198.51.100.1, " * 5_000 + "10.0.0.1",                 # 70 KB of real-looking entries
    ", ".join(_trusted_chain(4_000)),                       # all trusted: walks until the cap
    "," * 60_000,                                           # nothing but empty fields
    "a" * 60_000,                                           # one huge malformed field
    "1" * 30_000 + ", 10.0.0.1, " + "2" * 30_000,           # huge fields around a trusted one
    "203.0.113.9," + " " * 30_000 + "10.0.0.1" + " " * 30_000,  # a padded trusted one
    "203.0.113.9," + " " * 100 + "10.0.0.1",                # padded on the left only
    " " * 100 + "203.0.113.9, 10.0.0.1",                    # the same, not the last field
    "10.0.0.1, fe80::1%" + "z" * 60_000,                    # a long zone id
    "10.0.0.1, fe80::1%" + " " * 60_000,                    # an empty one
])
def test_the_walk_looks_at_few_fields_and_copies_only_short_ones(header: str) -> None:
    watched = WatchedHeader(header)
    resolved = ClientIPResolver(TRUSTED).resolve("127.0.0.1", watched)
    assert resolved == _reference_resolve(TRUSTED, "127.0.0.1", header)
    assert watched.searches <= MAX_FORWARDED_HOPS
    assert watched.longest_copy <= MAX_CACHED_ENTRY


def test_long_fields_keep_their_meaning() -> None:
    resolver = ClientIPResolver(TRUSTED)
    padded = " " * 30_000 + "203.0.113.5" + "\t" * 30_000
    assert resolver.resolve("127.0.0.1", padded).key == "203.0.113.5"
    zoned_peer = "fe80::1%" + "z" * 10_000
    assert resolver.resolve(zoned_peer, None) == ClientAddress(IPv6Address("fe80::1"), "fe80::/64")
    assert resolver.resolve("127.0.0.1", "203.0.113.5, " + "x" * 60_000).key == "127.0.0.1"
    assert resolver.resolve("a" * 60_000, None) == ClientAddress(None, "")


def _traced_growth(action) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        action()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("trusted", [[], TRUSTED], ids=["no trusted proxies", "trusted proxies"])
def test_memory_stays_bounded_with_distinct_huge_headers(trusted: list) -> None:
    resolver = ClientIPResolver(trusted)
    filler = "198.51.100.1, " * 3_600  # ~50 KB

    def send() -> None:
        for number in range(2_000):
            # Distinct everywhere, the rightmost fields included.
            header = f"{number}, {filler}{IPv4Address(0xC6120000 + number)}, 10.0.{number % 250}.1"
            peer = str(IPv4Address(0x7F000000 + number))
            resolver.resolve(peer, header)

    # 2,000 headers of 50 KB are 100 MB; the resolver may keep a few
    # thousand short entries of some hundred bytes.
    assert _traced_growth(send) < 3_000_000


def test_memory_stays_bounded_with_many_distinct_short_headers() -> None:
    # Each header is short enough to be remembered whole, with its fields.
    resolver = ClientIPResolver(TRUSTED, cache_size=4096)

    def send() -> None:
        for number in range(40_000):
            resolver.resolve("10.0.0.1", f"{IPv4Address(0xC6120000 + number)}, 10.0.{number % 250}.1")

    # Two caches of at most 4,096 entries of a few hundred bytes.
    assert _traced_growth(send) < 4_000_000
    assert len(resolver._walks) <= 4096 and len(resolver._cache) <= 4096


def test_a_rotation_of_addresses_is_not_stored_and_a_returning_client_is() -> None:
    """Behind SeenLately, a new address (each check of a rotation) is
    resolved without being stored: what it gave goes with its request.
    A client that comes back is stored from its second request and served
    from the cache after that."""
    resolver = ClientIPResolver(TRUSTED, cache_size=4096)
    resolver.resolve("127.0.0.1", "203.0.113.250")  # the proxy's address, stored from now on
    for number in range(20_000):
        header = str(IPv4Address(0xC6120000 + number))
        assert resolver.resolve("127.0.0.1", header) == _reference_resolve(TRUSTED, "127.0.0.1", header)
    # Stored: the peer, and the few whose hash's bits another address had
    # set (at most one in eight set), not one in two as the cache's cap
    # would have allowed.
    assert len(resolver._cache) < 20_000 // 8
    returning = "198.51.100.99"
    first, second, third = (resolver.resolve("127.0.0.1", returning) for _ in range(3))
    assert first == second == third
    assert returning in resolver._cache and third is second  # the third from the cache


@pytest.mark.parametrize("header", ["203.0.113.7", " 203.0.113.7 ", "not an address", "10.0.0.9", "",
                                    "2001:db8::1", "   "])
def test_a_header_of_one_field_is_remembered_once_as_that_field(header: str) -> None:
    """A header of one field (one proxy: a rotation of addresses sends
    nothing else) is resolved as its field, which the field cache
    remembers: the header cache, which a walk of two fields or more
    fills, stays empty, and the answer is the walk's."""
    resolver = ClientIPResolver(TRUSTED)
    for _ in range(2):  # stored the second time (SeenLately)
        assert resolver.resolve("127.0.0.1", header) == _reference_resolve(TRUSTED, "127.0.0.1", header)
    assert resolver._walks == {}
    assert len(resolver._cache) == (1 if header else 0) + 1  # the field, and the peer
    for _ in range(2):
        resolver.resolve("127.0.0.1", f"198.51.100.2, {header}")
    assert len(resolver._walks) == 1


# --------------------------------------------------------------------------
# Networks looked up by value
# --------------------------------------------------------------------------

ipv4_networks = st.builds(lambda value, length: ipaddress.IPv4Network((value, length), strict=False),
                          ipv4_ints, st.integers(min_value=0, max_value=32))
ipv6_networks = st.builds(lambda value, length: ipaddress.IPv6Network((value, length), strict=False),
                          ipv6_ints, st.integers(min_value=0, max_value=128))


@st.composite
def networks_and_address(draw: st.DrawFn) -> tuple[list, ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Networks of both versions and an address, often inside one of them."""
    networks = draw(st.lists(ipv4_networks | ipv6_networks, max_size=6))
    if networks and draw(st.booleans()):
        network = draw(st.sampled_from(networks))
        offset = draw(st.integers(min_value=0, max_value=network.num_addresses - 1))
        return networks, network.network_address + offset
    return networks, ipaddress.ip_address(draw(ipv4_ints) if draw(st.booleans()) else draw(ipv6_ints))


@given(networks_and_address())
def test_a_network_set_agrees_with_the_ipaddress_reference(case) -> None:
    """``NetworkSet.holds`` is ``any(address in network)``, for a client
    resolved from IPv4 text (its value only) and from an address object."""
    networks, address = case
    expected = any(address.version == network.version and address in network for network in networks)
    holder = NetworkSet(networks)
    clients = [ClientAddress(address, "k")]
    if address.version == 4:
        clients.append(ClientAddress(None, "k", int(address)))
    assert [holder.holds(client) for client in clients] == [expected] * len(clients)
    assert holder.holds_value(address.version, int(address)) == expected
    assert not holder.holds(ClientAddress(None, ""))  # the unknown client is in no network


def test_a_network_table_gives_the_values_of_the_holding_networks_longest_prefix_first() -> None:
    table = NetworkTable([(ip_network("10.0.0.0/8"), "wide"), (ip_network("10.1.0.0/16"), "narrow"),
                          (ip_network("10.1.0.0/16"), "second entry, dropped"), (ip_network("2001:db8::/32"), "six")])
    assert list(table.values(4, int(IPv4Address("10.1.2.3")))) == ["narrow", "wide"]
    assert list(table.values(4, int(IPv4Address("10.2.0.1")))) == ["wide"]
    assert list(table.values(4, int(IPv4Address("11.0.0.1")))) == []
    assert list(table.values(6, int(IPv6Address("2001:db8::1")))) == ["six"]


# --------------------------------------------------------------------------
# IPv6 in hex digits and colons, read without ipaddress
# --------------------------------------------------------------------------

hex_colon_text = st.text(alphabet="0123456789abcdefABCDEF:", max_size=44)
hex_groups = st.lists(st.text(alphabet="0123456789abcdefABCDEF", min_size=0, max_size=5), min_size=1, max_size=10)


@st.composite
def near_ipv6(draw: st.DrawFn) -> str:
    """Groups of hex digits (some too long, some empty) joined by colons,
    with a "::" or two somewhere: mostly near-misses of IPv6."""
    groups = draw(hex_groups)
    text = ":".join(groups)
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + "::" + text[at:]
    return text


def _ipaddress_value(text: str) -> int | None:
    try:
        return int(ipaddress.IPv6Address(text))
    except ValueError:
        return None


@given(st.one_of(hex_colon_text, near_ipv6(), ipv6_ints.flatmap(ipv6_spellings).filter(lambda text: "." not in text)))
def test_hex_and_colon_ipv6_is_read_as_ipaddress_reads_it(text: str) -> None:
    """The fast IPv6 path (the compiled core's one pass, the pure core's
    inet_pton over text of hex digits and colons) accepts exactly what
    ipaddress accepts, with the same value."""
    assert _plain_ipv6(text) == _ipaddress_value(text)


@given(st.one_of(hex_colon_text, near_ipv6(), ipv6_ints.flatmap(ipv6_spellings), st.text(max_size=41),
                 st.sampled_from(["::", ":::", "::1", "1::", ":1::", "::1:", "1:2:3:4:5:6:7::", "::1:2:3:4:5:6:7",
                                  "1:2:3:4:5:6:7:8::", "1:2:3:4:5:6:7:8:9", "1:2:3:4:5:6:7", "1::2::3",
                                  "12345::", "fe80::1%eth0", " ::1", "::1\n", "::\uff11", "::1.2.3.4",
                                  "0:0:0:0:0:0:0:0", "FFFF:ffff:FfFf:ffff:ffff:ffff:ffff:ffff"])))
def test_hex_ipv6_reads_what_the_pattern_inet_pton_and_ipaddress_read(text: str) -> None:
    """The compiled core's one pass over hex-and-colon IPv6 (``hex_ipv6``):
    the value ipaddress reads for text the pattern and inet_pton accept,
    -1 for anything else, whichever core runs it."""
    expected = -1
    if _PLAIN_IPV6.fullmatch(text) is not None:
        try:
            expected = int.from_bytes(socket.inet_pton(socket.AF_INET6, text), "big")
        except OSError:
            pass
        assert (None if expected < 0 else expected) == _ipaddress_value(text)
    assert hex_ipv6(text) == expected


@given(st.one_of(ipv6_ints, st.lists(st.sampled_from([0, 0, 0, 1, 0xF, 0x10, 0xFFFF]), min_size=8, max_size=8).map(
    lambda groups: int("".join(f"{group:04x}" for group in groups), 16))))
@example(0)
@example(1)
@example(0x0102_0304)  # ::1.2.3.4 to inet_ntop, ::102:304 to ipaddress
@example(0xFFFF_0000_0000)  # ::ffff:0.0.0.0 to inet_ntop, ::ffff:0:0 to ipaddress
@example(0x0001_0000_0000_0000_0001_0000_0000_0001)  # two runs of two: the first is "::"
@example(0x0001_0000_0000_0001_0000_0000_0000_0001)  # the longer, second run is
def test_an_ipv6_address_is_written_as_ipaddress_writes_it(value: int) -> None:
    assert ipv6_text(value) == str(IPv6Address(value))


@given(plain_ipv6_ints, st.sampled_from([64, 56, 48, 32, 1, 65, 96, 127, 128]))
def test_ipv6_keys_are_ipaddress_text(value: int, prefix: int) -> None:
    """A client read from hex-and-colon IPv6 has the key the ipaddress
    reference gives it, for every prefix, and its address on request."""
    text = str(IPv6Address(value))
    resolved = ClientIPResolver(ipv6_prefix=prefix).resolve(text, None)
    assert resolved == _reference_resolve([], text, None, 32, prefix)
    assert resolved.numeric == (6, value) and resolved.address == IPv6Address(value)


def test_a_mapped_address_in_hex_is_the_ipv4_client() -> None:
    resolved = ClientIPResolver().resolve("::ffff:c000:207", None)
    assert (resolved.key, resolved.numeric, resolved.address) == ("192.0.2.7", (4, 0xC0000207),
                                                                  IPv4Address("192.0.2.7"))


@given(ipv4_ints, plain_ipv6_ints)
@example(0, 0)
@example(0x7F000001, 1)  # ::1
@example(0xFFFFFFFF, 0x01020304)  # ::1.2.3.4 to inet_ntop, ::102:304 to ipaddress
@example(1, 0x1_0000_0000)  # ::1:0:0, the first written without a dotted quad
def test_a_client_read_from_its_value_is_written_as_ipaddress_writes_it(ipv4: int, ipv6: int) -> None:
    """``text`` (what a refusal's page shows) is ipaddress's text, and for
    all but the lowest IPv6 addresses reading it makes no address object."""
    clients = [ClientAddress(None, "k", ipv4), ClientAddress(None, "k", ipv6=ipv6)]
    assert [client.text for client in clients] == [str(IPv4Address(ipv4)), str(IPv6Address(ipv6))]
    assert clients[0]._address is None
    assert (clients[1]._address is None) == (ipv6 > 0xFFFFFFFF)


# --------------------------------------------------------------------------
# Exemption, told by the resolver
# --------------------------------------------------------------------------


@given(networks_and_address(), st.sampled_from([(32, 64), (24, 48), (32, 128)]), st.booleans())
def test_a_client_the_resolver_makes_knows_whether_the_exempt_networks_hold_it(case, prefixes, mapped) -> None:
    """The resolver looks an address up in the exempt networks once, when
    it makes the client: the answer is the ipaddress reference's, for the
    full address (not its key's network), from the cache too; other
    networks are looked up when asked."""
    networks, address = case
    exempt = NetworkSet(networks)
    expected = any(address.version == network.version and address in network for network in networks)
    text = f"::ffff:{address}" if mapped and address.version == 4 else str(address)
    resolver = ClientIPResolver((), *prefixes, cache_size=4, exempt=exempt)
    for _ in range(3):  # made, made again and stored (seen lately), then from the cache
        client = resolver.resolve(text, None)
        assert client.exempt_by is exempt
        assert client.exempt == client.exempt_in(exempt) == expected
    other = NetworkSet([ip_network("0.0.0.0/0"), ip_network("::/0")])
    assert client.exempt_in(other) and client.exempt_in(NetworkSet()) is False


def test_a_client_made_without_exempt_networks_is_looked_up_when_asked() -> None:
    exempt = NetworkSet([ip_network("10.0.0.0/8")])
    client = ClientIPResolver().resolve("10.1.2.3", None)
    assert client.exempt_by is None and client.exempt_in(exempt)
    assert not ClientIPResolver(exempt=exempt).resolve("11.1.2.3", None).exempt_in(exempt)
    assert not ClientIPResolver(exempt=exempt).resolve("junk", None).exempt_in(exempt)  # the unknown client
