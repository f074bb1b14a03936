"""Query parameters: the same as the standard library's parser gives; cookies:
what a plain reading of the Cookie field gives."""

from urllib.parse import parse_qsl

from hypothesis import given
from hypothesis import strategies as st

from sidecar.request import parse_cookies, parse_query

query_text = st.lists(st.sampled_from(list("ab=&+%20x;é") + ["%41", "%e9", "%zz", "=="]),
                      max_size=20).map("".join)


def reference(query_string: str) -> dict[str, str]:
    query: dict[str, str] = {}
    for name, value in parse_qsl(query_string, keep_blank_values=True):
        query.setdefault(name, value)
    return query


@given(query_text)
def test_query_parameters_match_the_standard_parser(query_string: str) -> None:
    assert parse_query(query_string) == reference(query_string)


def test_the_first_value_of_a_repeated_parameter_counts() -> None:
    assert parse_query("q=shoes&q=hats&page=2&flag") == {"q": "shoes", "page": "2", "flag": ""}


@given(st.text(max_size=30))
def test_any_text_parses_as_the_standard_parser_does(query_string: str) -> None:
    assert parse_query(query_string) == reference(query_string)


cookie_text = st.lists(st.sampled_from(list("ab=; \t\u00a0é") + ["sid", "==", " =x", "sid=s1", ";;"]),
                       max_size=20).map("".join)


def cookie_reference(field: str) -> dict[str, str]:
    """Each part between semicolons, stripped: its name before the first
    "=" (not empty), its value after it, stripped; the first of a name."""
    cookies: dict[str, str] = {}
    for part in field.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep and name and name not in cookies:
            cookies[name] = value.strip()
    return cookies


@given(cookie_text | st.text(max_size=30))
def test_cookies_parse_as_a_plain_reading_of_the_field(field: str) -> None:
    assert parse_cookies(field) == cookie_reference(field)


def test_the_first_cookie_of_a_name_counts_and_a_part_without_a_name_is_skipped() -> None:
    assert parse_cookies(" sid= s1 ; =x; sid=s2;flag;a=b=c") == {"sid": "s1", "a": "b=c"}
