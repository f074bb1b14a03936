"""Query parameters: the same as the standard library's parser gives; cookies:
what a plain reading of the Cookie field gives."""

from urllib.parse import parse_qsl

from hypothesis import example, given, settings
from hypothesis import strategies as st

from sidecar.clientip import ClientIPResolver
from sidecar.request import CheckRequest, cookie_value, parse_cookies, parse_query, query_value

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


CLIENT = ClientIPResolver().resolve("192.0.2.1", None)
names = st.sampled_from(["q", "a", "b", "", "a b", "a=b", "sid", "sid ", " sid", "é", "x", "%41", "+"])


def made(query_string: str = "", cookie: str | None = None) -> CheckRequest:
    return CheckRequest("GET", "example.com", f"/p?{query_string}", {} if cookie is None else {"cookie": cookie},
                        CLIENT, "r")


@settings(max_examples=400)
@given(query_text | st.text(max_size=30), names | st.text(max_size=4), st.booleans())
@example("qq=1&q&q=2", "q", False)
def test_a_parameter_read_in_place_is_the_parsed_parameter(query_string: str, name: str, parsed_first: bool) -> None:
    """A program's read of one parameter (``query_value``), in place or
    from the parsed parameters, gives what ``parse_query`` gives."""
    request = made(query_string)
    if parsed_first:
        assert request.query is not None
    assert query_value(request, name) == parse_query(query_string).get(name)


@settings(max_examples=400)
@given(cookie_text | st.text(max_size=30), names | st.text(max_size=4), st.booleans())
@example("\tsid=s1", "sid", False)  # any whitespace before a name is stripped, not only spaces
@example("a=1;\u00a0sid =x; sid=s2 ", "sid", False)
def test_a_cookie_read_in_place_is_the_parsed_cookie(field: str, name: str, parsed_first: bool) -> None:
    request = made(cookie=field)
    if parsed_first:
        assert request.cookies is not None
    assert cookie_value(request, name) == parse_cookies(field).get(name)


def test_reads_in_place_find_the_first_of_a_name() -> None:
    assert query_value(made("page=2&q=shoes&q=hats&flag"), "q") == "shoes"
    assert query_value(made("page=2&flag&q"), "flag") == ""
    assert query_value(made("qq=1&q2=2"), "q") is None
    assert cookie_value(made(cookie=" sidx=1; sid = s0 ;  sid= s1 ; sid=s2"), "sid") == "s1"
    assert cookie_value(made(cookie="sid"), "sid") is None
