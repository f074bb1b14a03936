# Types of sidecar/clientip.py for its compiled build (see setup.py): a
# resolved client and the resolver are extension types (the resolver's walk
# calls its steps in C); the fast paths of IPv4 and IPv6 text are compiled,
# canonical IPv4 read in C.
cimport cython

from sidecar.bounded cimport SeenLately


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


cdef unsigned long long _LOW64
cdef bytearray _SCRATCH
cdef const char *_HEX_DIGITS


cdef unsigned int _hextet(unsigned long long high, unsigned long long low, int index) noexcept


@cython.locals(high=cython.ulonglong, low=cython.ulonglong, group=cython.uint, index=cython.int, start=cython.int,
               best=cython.int, best_run=cython.int, out="char *", length=Py_ssize_t, shift=cython.int)
cpdef str ipv6_text(value)


@cython.locals(length=Py_ssize_t, high=cython.ulonglong, low=cython.ulonglong, head_high=cython.ulonglong,
               head_low=cython.ulonglong, head=cython.int, groups=cython.int, group=cython.ulonglong,
               digits=cython.int, previous=cython.int, code=cython.int, digit=cython.int,
               character=cython.Py_UCS4, shift=cython.int, whole=object)
cpdef object hex_ipv6(str text)


cpdef bint levels_hold(dict levels, version, value) except -1


# The header and the peer are any str (the tests watch the walk through a
# subclass); a field cut from them is a str.
cdef class ClientIPResolver:
    cdef readonly object trusted_proxies
    cdef dict _trusted
    cdef public object exempt
    cdef public int ipv4_prefix
    cdef public int ipv6_prefix
    cdef public Py_ssize_t cache_size
    cdef public dict _cache
    cdef public dict _walks
    cdef SeenLately _seen
    cdef public object _ipv4_mask
    cdef public object _ipv6_mask

    @cython.locals(entry=tuple, client=ClientAddress, end=Py_ssize_t)
    cpdef ClientAddress resolve(self, peer, forwarded_for)
    @cython.locals(end=Py_ssize_t, hops=Py_ssize_t, start=Py_ssize_t, entry=tuple)
    cpdef ClientAddress _walk_forwarded_for(self, ClientAddress client, header)
    @cython.locals(entry=tuple)
    cpdef tuple _entry(self, text, Py_ssize_t start, Py_ssize_t end)
    @cython.locals(entry=tuple, client=ClientAddress)
    cpdef tuple _classify(self, str field)
    @cython.locals(text=str)
    cpdef tuple _parse(self, str field)
    cpdef str _ipv6_key(self, value)
