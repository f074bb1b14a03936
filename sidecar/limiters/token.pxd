# Types of sidecar/limiters/token.py for its compiled build (see setup.py):
# the state and the token bucket are extension types, tokens and times C doubles.
cimport cython

from sidecar.limiters.bucket cimport Bucket, in_penalty
from sidecar.limiters.records cimport Hit, admitted


# A new state's penalty_until, a C double (sidecar.limiters.NO_PENALTY).
cdef double NO_PENALTY

cdef class TokenState:
    cdef public double tokens
    cdef public object last
    cdef public double penalty_until
    cdef public object limiter
    cdef public bint used


cdef class TokenBucket(Bucket):
    cdef public object capacity
    cdef public double refill
    cdef public object cost

    @cython.locals(state=TokenState)
    cpdef TokenState new_state(self)
    @cython.locals(last=double)
    cpdef double tokens_at(self, TokenState state, double now) except? -1.0
    # The Algorithm's methods take any state, each read as a TokenState (record).
    @cython.locals(record=TokenState, tokens=double, cost=double)
    cpdef Hit assess(self, state, double now, lease=*, amount=*)
    @cython.locals(record=TokenState)
    cpdef commit(self, state, Hit hit)
    @cython.locals(record=TokenState, full_at=double, last=double)
    cpdef double expires_at(self, state) except? -1.0
