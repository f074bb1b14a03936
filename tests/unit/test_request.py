"""Query parameters: the same as the standard library's parser gives."""

from urllib.parse import parse_qsl

from hypothesis import given
from hypothesis import strategies as st

from sidecar.request import parse_query

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
