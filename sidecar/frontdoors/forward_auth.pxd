# Types of sidecar/frontdoors/forward_auth.py for its compiled build (see setup.py).
cimport cython

from sidecar.request cimport CheckRequest, check_request


cpdef CheckRequest describe_forward_auth(scope, dict headers)
