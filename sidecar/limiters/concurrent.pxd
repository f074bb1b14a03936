# Types of sidecar/limiters/concurrent.py for its compiled build (see setup.py):
# the state and the concurrency limiter are extension types.
cimport cython

from sidecar.limiters.records cimport Algorithm, Hit, admitted, refused


cdef class LeaseState:
    cdef public dict held
    cdef public object limiter
    cdef public bint used


cdef class ConcurrencyLimiter(Algorithm):
    cdef public object limit
    cdef public double lease
    cdef public tuple _lua_limit

    cpdef LeaseState new_state(self)
    @cython.locals(held=dict)
    cpdef _refusal(self, LeaseState state, double now)
    # The Algorithm's methods take any state, each read as a LeaseState
    # (_refusal's argument, or record).
    cpdef Hit peek(self, state, double now)
    cpdef Hit assess(self, state, double now, lease=*, amount=*)
    @cython.locals(record=LeaseState)
    cpdef commit(self, state, Hit hit)
    @cython.locals(hit=Hit)
    cpdef Hit hit(self, state, double now, double threshold, amount=*)
    @cython.locals(record=LeaseState)
    cpdef double expires_at(self, state) except? -1.0
