# Types of sidecar/limiters/bucket.py for its compiled build (see setup.py):
# the buckets' base is an extension type. The .py stays the reference.
cimport cython

from sidecar.limiters.records cimport Hit, refused


cdef class Bucket:
    cdef public object penalty
    cdef public double per_second
    cdef public tuple _lua_args

    cpdef refuse(self, state, double now, double wait)
    cpdef peek(self, state, double now)
