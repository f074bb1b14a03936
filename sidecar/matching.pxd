# Types of sidecar/matching.py for its compiled build (see setup.py): a
# program's nodes, parts and steps are extension types, walked by C
# functions that read the request's fields in C.
cimport cython

from sidecar._statemap cimport StateMap
from sidecar.request cimport CheckRequest, cookie_value, query_value
from sidecar.state cimport Check, CheckSpec

cdef int _ALL, _ANY, _NOT, _CALL, _PATH, _HOST, _METHOD, _HEADER, _COOKIE, _QUERY
cdef int _EQUALS, _IN, _PREFIX, _REGEX, _PRESENT, _ABSENT
cdef int _CLIENT, _URI, _SESSION


cdef class Node:
    cdef readonly int kind
    cdef readonly int op
    cdef readonly str name
    cdef readonly str text
    cdef readonly frozenset values
    cdef readonly object function
    cdef readonly tuple parts
    cdef readonly dict memo


cdef class Part:
    cdef readonly int kind
    cdef readonly str name
    cdef readonly object function


cdef class Step:
    cdef readonly Node condition
    cdef readonly bint challenge
    cdef readonly object rule
    cdef readonly CheckSpec spec
    cdef readonly object prefix
    cdef readonly tuple parts


cdef class Program:
    cdef readonly tuple steps

    @cython.locals(steps=tuple, index=Py_ssize_t, step=Step, parts=tuple, count=Py_ssize_t, check=Check, headers=dict)
    cpdef bint run(self, CheckRequest request, client_key, list matched, list checks, lease, has_credential,
                   StateMap states=*)


@cython.locals(kind=int, op=int, name=str, memo=dict)
cdef bint _holds(Node node, CheckRequest request, method, host, path, dict headers, client_key) except -1

@cython.locals(kind=int)
cdef object _value(Part part, CheckRequest request, method, host, path, dict headers, client_key)
