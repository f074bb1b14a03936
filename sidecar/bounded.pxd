# Types of sidecar/bounded.py for its compiled build (see setup.py): the
# bounded map is an extension type over a dict.
cimport cython

from sidecar.limiters.records cimport Algorithm
from sidecar.keystate cimport limiter_of


cpdef long long wheel_slot(double when) noexcept


cdef class BoundedMap:
    cdef public Py_ssize_t max_keys
    cdef public object _expires_at
    cdef public object _clock
    cdef public dict data
    cdef public dict _wheel
    cdef public list _slots
    cdef public Py_ssize_t _filed

    @cython.locals(data=dict)
    cpdef get(self, key)
    @cython.locals(data=dict)
    cpdef add(self, key, value, expires=*)
    cpdef double _expiry(self, value) except? -1.0
    @cython.locals(keys=list, slot="long long")
    cpdef _file(self, key, double expires)
    @cython.locals(data=dict)
    cpdef _drop_oldest(self, Py_ssize_t count)


cdef class StateMap(BoundedMap):
    cpdef double _expiry(self, value) except? -1.0
    @cython.locals(data=dict)
    cpdef get(self, key)
    @cython.locals(data=dict)
    cpdef _drop_oldest(self, Py_ssize_t count)


@cython.locals(limiter=Algorithm)
cpdef double state_expiry(state) except? -1.0


@cython.final
cdef class SeenLately:
    cdef bytearray _bits
    cdef Py_ssize_t _mask
    cdef Py_ssize_t _new
    cdef readonly Py_ssize_t generation
    cdef dict _started

    cpdef bint again(self, value) except -1
    @cython.locals(slot=Py_ssize_t, mask=cython.uchar, byte=cython.uchar, bits=bytearray)
    cpdef bint again_at(self, Py_ssize_t number) except -1
    @cython.locals(started=Py_ssize_t)
    cpdef remember(self, dict cache, value, answer, Py_ssize_t size)
