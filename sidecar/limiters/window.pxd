# Types of sidecar/limiters/window.py for its compiled build (see setup.py):
# the state and the counter are extension types, their times C doubles and
# their counts C integers. The .py stays the reference and the pure-Python core.
cimport cython

from sidecar.limiters.records cimport Hit, refused


cdef class WindowState:
    cdef public long long window
    cdef public long long previous
    cdef public long long current
    cdef public double penalty_until
    cdef public object limiter
    cdef public bint used


cdef class WindowCounter:
    cdef public object threshold
    cdef public double period
    cdef public double penalty
    cdef public bint sliding
    cdef public bint exceed
    cdef public bint fit
    cdef public tuple _lua_limit
    cdef public tuple _lua_args
    cdef public object _window

    cpdef WindowState new_state(self)
    cpdef peek(self, WindowState state, double now)
    @cython.locals(window="long long", estimate=double, elapsed=double)
    cpdef hit(self, WindowState state, double now, double threshold, amount=*)
    @cython.locals(elapsed=double, previous=double)
    cpdef _fit(self, WindowState state, double now, double threshold, amount)
