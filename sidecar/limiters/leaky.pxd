# Types of sidecar/limiters/leaky.py for its compiled build (see setup.py):
# the state and the leaky bucket are extension types. The arithmetic stays
# on Python ints, nginx's integer for integer, but for a key's expiry,
# worked on C integers while they fit (expires_at, _kept_ms).
cimport cython

from sidecar.limiters.bucket cimport Bucket, in_penalty
from sidecar.limiters.records cimport Hit, admitted


# A new state's penalty_until, a C double (sidecar.limiters.NO_PENALTY).
cdef double NO_PENALTY

cdef class LeakyState:
    cdef public object excess
    cdef public object last
    cdef public double penalty_until
    cdef public object limiter
    cdef public bint used


cdef inline bint _in_c_range(last, excess, rate) except -1
@cython.locals(drained="long long")
cdef long long _kept_ms(long long last, long long excess, long long rate) noexcept
@cython.locals(elapsed="long long", full="long long", empty_after="long long", left="long long")
cdef long long _drained_excess(long long last, long long excess, long long rate, long long now_ms,
                               long long amount) noexcept


cdef class LeakyBucket(Bucket):
    cdef public object rate
    cdef public object burst
    cdef public object delay
    cdef public bint holds

    @cython.locals(state=LeakyState)
    cpdef LeakyState new_state(self)
    # The Algorithm's methods take any state, each read as a LeakyState (record).
    @cython.locals(record=LeakyState)
    cpdef Hit assess(self, state, double now, lease=*, amount=*)
    @cython.locals(record=LeakyState)
    cpdef commit(self, state, Hit hit)
    @cython.locals(record=LeakyState, seconds=double)
    cpdef double expires_at(self, state) except? -1.0
    cpdef _excess(self, LeakyState state, now_ms, amount=*)
    cpdef _wait_ms(self, LeakyState state, now_ms, amount=*)
