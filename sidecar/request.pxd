# Types of sidecar/request.py for its compiled build (see setup.py): the
# request a front door describes is an extension type, made and read in C.
cimport cython

from sidecar.clientip cimport ClientAddress


cdef class CheckRequest:
    cdef public object method
    cdef public object host
    cdef public object uri
    cdef public object path
    cdef public object query_string
    cdef public object headers
    cdef public ClientAddress client
    cdef public object peer
    cdef public object forwarded_for
    cdef public object request_id
    cdef public object tls_fingerprint
    cdef public double sent
    cdef public double refused_until
    cdef public object refused_as
    cdef public object proxy_expires
    cdef public bint credential
    cdef public object token
    cdef public object _cookies
    cdef public object _query


@cython.locals(path=str, trailing=bint)
cpdef str normalise_path(str raw_path)

cpdef CheckRequest check_request(dict headers, str method, host, str uri, str peer, str host_field=*)

@cython.locals(cookies=dict)
cpdef dict cookies_of(CheckRequest request)

@cython.locals(query=dict)
cpdef dict query_of(CheckRequest request)

@cython.locals(query=dict, text=str, size=Py_ssize_t, end=Py_ssize_t, start=Py_ssize_t, stop=Py_ssize_t,
               after=Py_ssize_t)
cpdef query_value(CheckRequest request, str name)

@cython.locals(cookies=dict, field=str, value=str, size=Py_ssize_t, end=Py_ssize_t, start=Py_ssize_t,
               stop=Py_ssize_t, first=Py_ssize_t, after=Py_ssize_t)
cpdef cookie_value(CheckRequest request, str name)

@cython.locals(query=dict, name=str, value=str, end=Py_ssize_t, start=Py_ssize_t, stop=Py_ssize_t,
               equals=Py_ssize_t)
cpdef dict parse_query(str query_string)

@cython.locals(cookies=dict, part=str, cookie=str, name=str, value=str, equals=Py_ssize_t)
cpdef dict parse_cookies(str field)
