# Types of sidecar/limiters/window.py for its compiled build (see setup.py):
# the state and the counter are extension types, their times C doubles and
# their counts C integers. The .py stays the reference and the pure-Python core.
cimport cython

from sidecar.limiters.records cimport Algorithm, Hit, refused


# A new state's penalty_until, a C double (sidecar.limiters.NO_PENALTY).
cdef double NO_PENALTY

cdef class WindowState:
    cdef public long long window
    cdef public long long previous
    cdef public long long current
    cdef public double penalty_until
    cdef public object limiter
    cdef public bint used


cdef class WindowCounter(Algorithm):
    cdef public object threshold
    cdef public double period
    cdef public double penalty
    cdef public bint sliding
    cdef public bint exceed
    cdef public bint fit
    cdef public tuple _lua_limit
    cdef public tuple _lua_args
    cdef public object _window

    @cython.locals(state=WindowState)
    cpdef WindowState new_state(self)
    # The Algorithm's methods take any state, each read as a WindowState (record).
    @cython.locals(record=WindowState)
    cpdef Hit peek(self, state, double now)
    @cython.locals(record=WindowState, window="long long", estimate=double, elapsed=double, added="long long")
    cpdef Hit hit(self, state, double now, double threshold, amount=*)
    @cython.locals(elapsed=double, previous=double)
    cpdef Hit _fit(self, WindowState state, double now, double threshold, amount)
    @cython.locals(record=WindowState, horizon=double, penalty_until=double)
    cpdef double expires_at(self, state) except? -1.0
