"""Redis key names of the shared backend (SPEC §9)."""

import json

from hypothesis import given
from hypothesis import strategies as st

from sidecar.store.redis import BAN_INDEX, PREFIX, ban_key, counting_key
from sidecar.state import AutoBan

values = st.text(max_size=12)
keys = st.tuples(st.tuples(st.text(min_size=1, max_size=8), st.lists(values, max_size=3).map(tuple)),
                 values, values)


def test_a_counting_key_is_the_json_of_its_tuple_under_the_hash_tag() -> None:
    assert counting_key((("pages", ("ip",)), "192.0.2.1")) == '{sluice}:count:[["pages",["ip"]],"192.0.2.1"]'


# A key's values: text, or the session fallback's tagged pair.
any_values = st.one_of(st.text(max_size=12), st.tuples(st.just("ip"), st.text(max_size=12)))
any_keys = st.tuples(st.tuples(st.text(min_size=1, max_size=8), st.lists(values, max_size=3).map(tuple)),
                     any_values, any_values)


@given(any_keys)
def test_a_counting_key_name_is_exactly_the_json_of_the_tuple(key) -> None:
    assert counting_key(key) == "{sluice}:count:" + json.dumps(key, separators=(",", ":"))


@given(keys, keys)
def test_different_counting_keys_never_share_a_name(a, b) -> None:
    assert (counting_key(a) == counting_key(b)) == (a == b)


@given(keys)
def test_every_key_shares_one_cluster_hash_tag(key) -> None:
    # Redis Cluster hashes only what is inside the first {...}: one slot for
    # all, so the multi-key scripts are valid there.
    for name in (counting_key(key), ban_key("192.0.2.1"), BAN_INDEX, counting_key(AutoBan.key("x"))):
        assert name.startswith(PREFIX) and PREFIX == "{sluice}:"
