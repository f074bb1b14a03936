# Types of sidecar/limiters/bucket.py for its compiled build (see setup.py):
# the buckets' base is an extension type. The .py stays the reference.
cimport cython

from sidecar.limiters.records cimport Algorithm, Hit, refused


cpdef Hit in_penalty(double penalty_until, double now)


cdef class Bucket(Algorithm):
    cdef public object penalty
    cdef public double per_second
    cdef public tuple _lua_args

    cpdef refuse(self, state, double now, double wait)
    cpdef Hit peek(self, state, double now)
    @cython.locals(hit=Hit)
    cpdef Hit hit(self, state, double now, double threshold, amount=*)
