"""The check latency histogram (``sluice_check_duration_seconds``), observed
with every check, and the counters a check adds to (``Tally``, and
``RuleSetCount``: the requests of one set of rules).

The compiled core builds them as C types (the ``.pxd`` beside this file):
an observation is then a C call from the check's door (sidecar.app), where
a Python method with ``bisect`` cost about 2,400 instructions, a thirtieth
of a check without rules, and a count one addition to a C field of the
engine's (sidecar.engine), where reading the counter from the metrics and
its value by name cost three attribute lookups. sidecar.metrics reads them
at scrape time.
"""

from __future__ import annotations

# Upper bounds of the buckets, in seconds (Prometheus' ``le``), increasing;
# a last bucket above them all is ``+Inf``.
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class LatencyHistogram:
    """Counts per bucket, their sum and their number; no lock (one event
    loop's thread)."""

    __slots__ = ("counts", "total", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        # The first bucket whose bound is not below ``seconds`` (bisect_left's),
        # looked for from the first: nearly every check falls in it.
        index = 0
        while index < len(LATENCY_BUCKETS):
            bound: float = LATENCY_BUCKETS[index]  # compiled: compared as C doubles, no float made
            if not bound < seconds:
                break
            index += 1
        self.counts[index] += 1
        self.total += seconds
        self.count += 1


class Tally:
    """A counter without a lock."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount


class RuleSetCount:
    """Requests counted by one set of rules (``Metrics.rule_sets``) since
    the set was last added up; ``live`` until then. The engine keeps the
    count of the set that counted its last request, and adds to it while
    the same rules count and it is live."""

    __slots__ = ("value", "live")

    def __init__(self) -> None:
        self.value = 0
        self.live = True
