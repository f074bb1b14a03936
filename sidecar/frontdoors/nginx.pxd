# Types of sidecar/frontdoors/nginx.py for its compiled build (see setup.py).
cimport cython

from sidecar.request cimport CheckRequest, check_request


cpdef CheckRequest describe_nginx(scope, dict headers)
