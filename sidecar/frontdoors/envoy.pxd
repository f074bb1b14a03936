# Types of sidecar/frontdoors/envoy.py for its compiled build (see setup.py).
cimport cython

from sidecar.request cimport CheckRequest, check_request


cpdef CheckRequest describe_envoy(scope, dict headers)
