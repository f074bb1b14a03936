"""A request's header fields by name: the one-pass map is the field-by-field join."""

from hypothesis import given
from hypothesis import strategies as st

from sidecar.frontdoors.common import header_map, join_fields

# Few names, in every case, so that repeats (cookies included) are common;
# bytes over 0x7f too, which latin-1 keeps.
names = st.sampled_from([b"cookie", b"Cookie", b"x-a", b"X-A", b"x-\xc0", b"x-\xe0", b"host", b"accept"])
values = st.binary(max_size=6)
fields = st.lists(st.tuples(names, values), max_size=12)


def reference(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return join_fields([(name.decode("latin-1"), value.decode("latin-1")) for name, value in raw])


@given(fields)
def test_the_map_is_the_join_of_the_fields(raw: list[tuple[bytes, bytes]]) -> None:
    headers = header_map({"headers": raw})
    assert headers == reference(raw)
    assert list(headers) == list(reference(raw))  # first-seen order too


def test_repeated_names_are_joined_whatever_their_case() -> None:
    raw = [(b"Cookie", b"a=1"), (b"x-a", b"1"), (b"cookie", b"b=2"), (b"X-A", b"2")]
    assert header_map({"headers": raw}) == {"cookie": "a=1; b=2", "x-a": "1, 2"}
