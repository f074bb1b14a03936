# Types of sidecar/clientip.py for its compiled build (see setup.py): a
# resolved client is an extension type; the resolver's walk and the fast
# paths of IPv4 and IPv6 text are compiled, canonical IPv4 read in C.
cimport cython


cdef class ClientAddress:
    cdef public object key
    cdef public object text
    cdef public object numeric
    cdef public object _address
    cdef public object _ipv4
    cdef public object _ipv6
    cdef public object exempt_by
    cdef public bint exempt


@cython.locals(value=cython.ulonglong, octet=cython.int, digits=cython.int, dots=cython.int,
               character=cython.Py_UCS4, code=cython.int)
cpdef long long dotted_quad(str text)
