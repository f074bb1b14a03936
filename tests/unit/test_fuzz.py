"""Whatever the proxy forwards, the check endpoints answer with a defined
decision, never an exception (a 500 the proxy would turn into an outage)."""

import asyncio
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.app import SluiceApp
from sidecar.hook import report_from_datagram

from .conftest import Harness

RULES = """
client_ip: {trusted_proxies: [127.0.0.0/8, "::1/128"]}
rules:
  - id: keyed
    match: {any: [{path: {regex: "^/a"}}, {header: {name: x-k, present: true}}, {cookie: {name: s, prefix: v}}]}
    key: [ip, "header:x-k", "cookie:s", "query:q", "session:sid", uri, host, method]
    limit: {requests: 2, per: 10s}
    action: block
  - id: login
    key: [ip]
    limit: {requests: 1, per: 10s}
    count_on: {status: [401]}
    action: block
  - id: bucket
    key: [path]
    limit: {rate: 5r/s, burst: 1, nodelay: true}
    action: log
"""

latin1 = st.text(st.characters(min_codepoint=0, max_codepoint=255), max_size=40)
header_names = st.sampled_from(["x-sluice-client-addr", "x-original-uri", "x-original-method",
                                "x-original-host", "x-forwarded-for", "x-k", "cookie", "host",
                                "x-request-id", "x-sluice-deny", "x-forwarded-uri"])
addresses = st.one_of(latin1, st.ip_addresses().map(str),
                      st.sampled_from(["::ffff:1.2.3.4", "fe80::1%eth0", "1.2.3.4, junk", " ", "300.1.1.1"]))
headers = st.lists(st.tuples(st.one_of(header_names, latin1.filter(bool)),
                             st.one_of(latin1, addresses)), max_size=12)
paths = st.sampled_from(["/v1/nginx/auth", "/v1/check", "/v1/envoy/auth", "/v1/envoy/auth/a%2F..%00",
                         "/v1/nginx/deny"])


def run(app, path, raw_headers, client):
    scope = {"type": "http", "path": path, "raw_path": path.encode("latin-1"), "method": "GET",
             "query_string": b"q=%FF&q=2", "client": client,
             "headers": [(n.lower().encode("latin-1"), v.encode("latin-1")) for n, v in raw_headers]}
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


@settings(max_examples=400, deadline=None)
@given(path=paths, raw_headers=headers, peer=addresses)
def test_any_request_gets_a_defined_answer(path, raw_headers, peer):
    h = Harness(RULES)
    app = SluiceApp(h.engine)
    for _ in range(3):
        sent = run(app, path, raw_headers, (peer, 1234))
        if sent:  # a held request whose client went away gets no answer
            assert 200 <= sent[0]["status"] <= 599
    assert h.engine.metrics.errors.value == 0


@settings(max_examples=300, deadline=None)
@given(payload=st.one_of(st.binary(max_size=200),
                         st.dictionaries(st.sampled_from(["token", "status", "headers"]),
                                         st.one_of(latin1, st.integers(), st.none(),
                                                   st.dictionaries(latin1, latin1, max_size=3)))
                         .map(lambda d: json.dumps(d).encode())))
def test_any_report_datagram_is_counted_or_refused(payload):
    h = Harness(RULES)
    assert report_from_datagram(h.engine, b"<190>Nov 30 sluice: " + payload) in (0, 1)
