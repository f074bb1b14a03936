# Types of sidecar/limiters/concurrent.py for its compiled build (see setup.py):
# the state and the concurrency limiter are extension types.
cimport cython

from sidecar.limiters.records cimport Hit, admitted, refused


cdef class LeaseState:
    cdef public dict held
    cdef public object limiter
    cdef public bint used


cdef class ConcurrencyLimiter:
    cdef public object limit
    cdef public double lease
    cdef public tuple _lua_limit

    cpdef LeaseState new_state(self)
    @cython.locals(held=dict)
    cpdef _refusal(self, LeaseState state, double now)
    cpdef assess(self, LeaseState state, double now, lease=*, amount=*)
