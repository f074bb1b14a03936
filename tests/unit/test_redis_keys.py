"""Redis key names of the shared backend."""

import binascii
import json
import re
import zlib

from hypothesis import given
from hypothesis import strategies as st

from sidecar.state import AutoBan
from sidecar.store.redis import PREFIX, ban_key, counting_key
from sidecar.store.redis_cluster import key_slot

values = st.text(max_size=12)
keys = st.tuples(st.tuples(st.text(min_size=1, max_size=8), st.lists(values, max_size=3).map(tuple)),
                 values, values)


def test_a_counting_key_is_the_json_of_its_tuple_under_its_subject_tag() -> None:
    assert counting_key((("pages", ("ip",)), "192.0.2.1")) == \
        'sluice:{192.0.2.1}:count:[["pages",["ip"]],"192.0.2.1"]'
    body = '[["api",["header:x-api-key"]],"k"]'
    assert counting_key((("api", ("header:x-api-key",)), "k")) == \
        f"sluice:{{{zlib.crc32(body.encode()):08x}}}:count:{body}"


# A key's values: text, or the session fallback's tagged pair.
any_values = st.one_of(st.text(max_size=12), st.tuples(st.just("ip"), st.text(max_size=12)))
any_keys = st.tuples(st.tuples(st.text(min_size=1, max_size=8), st.lists(values, max_size=3).map(tuple)),
                     any_values, any_values)


@given(any_keys)
def test_a_counting_key_name_is_exactly_the_json_of_the_tuple(key) -> None:
    name = counting_key(key)
    assert name.startswith(PREFIX + "{")
    assert name.split("}:count:", 1)[1] == json.dumps(key, separators=(",", ":"))


@given(keys, keys)
def test_different_counting_keys_never_share_a_name(a, b) -> None:
    assert (counting_key(a) == counting_key(b)) == (a == b)


def hash_tag(name: str) -> str:
    return re.match(r"[^{]*\{([^}]*)\}", name).group(1)


addresses = st.one_of(st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(lambda a: f"{a}/64"))


@given(addresses, st.lists(st.sampled_from(["host", "path", "header:x-api-key", "query:q"]), max_size=3,
                           unique=True), st.lists(values, min_size=4, max_size=4))
def test_keys_that_count_per_address_share_the_slot_of_its_ban_record(address, others, texts) -> None:
    # On a Redis Cluster a client's per-address checks, its challenge
    # counter and its ban record are then one slot: one atomic script.
    names = tuple(sorted(["ip", *others]))
    key = (("rule", names), *(address if name == "ip" else texts[i] for i, name in enumerate(names)))
    for name in (counting_key(key), counting_key(AutoBan.key(address)), ban_key(address)):
        assert hash_tag(name) == address
        assert key_slot(name) == key_slot(ban_key(address))


@given(st.lists(values, min_size=1, max_size=3))
def test_keys_without_an_address_are_tagged_by_themselves(texts) -> None:
    names = tuple(f"header:h{i}" for i in range(len(texts)))
    name = counting_key((("rule", names), *texts))
    assert hash_tag(name) == f"{zlib.crc32(name.split('}:count:', 1)[1].encode()):08x}"


def test_key_slot_is_redis_cluster_s() -> None:
    # The examples of the Redis Cluster specification, and its hash tag rules.
    assert key_slot("123456789") == 0x31C3 & 16383 == binascii.crc_hqx(b"123456789", 0) & 16383
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers") == key_slot("user1000")
    assert key_slot("foo{}{bar}") == binascii.crc_hqx(b"foo{}{bar}", 0) & 16383
    assert key_slot("foo{{bar}}zap") == key_slot("{bar")
    assert key_slot("foo{bar}{zap}") == key_slot("bar")
