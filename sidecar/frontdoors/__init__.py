"""The front doors: one module per proxy protocol, each turning the proxy's
request into one ``CheckRequest`` and a ``Decision`` back into the proxy's
answer (STYLE: adapters at the edges).

A front door declares its ``ROUTES`` (a path, or a prefix, to a
``Check(describe, answer)`` or an endpoint) and is listed here;
``sidecar.app.SluiceApp`` dispatches through the table.
"""

from __future__ import annotations

from sidecar.frontdoors import challenge_solution, envoy, forward_auth, hook, nginx
from sidecar.frontdoors.common import Route

ROUTES: tuple[Route, ...] = (
    *nginx.ROUTES,
    *envoy.ROUTES,
    *forward_auth.ROUTES,
    *challenge_solution.ROUTES,
    *hook.ROUTES,
)
