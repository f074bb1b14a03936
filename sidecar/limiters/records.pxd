# Types of sidecar/limiters/records.py for its compiled build (see setup.py):
# a limiter's answer is an extension type, made without a call of its class,
# and the limiters' base one whose methods the policy calls in C.
cimport cython


cdef class Hit:
    cdef public bint over_limit
    cdef public double retry_after
    cdef public double delay
    cdef public object proposal


@cython.locals(hit=Hit)
cpdef Hit admitted(double delay, proposal)
@cython.locals(hit=Hit)
cpdef Hit refused(double retry_after)


cdef class Algorithm:
    cpdef new_state(self)
    cpdef Hit peek(self, state, double now)
    cpdef Hit hit(self, state, double now, double threshold, amount=*)
    cpdef Hit assess(self, state, double now, lease=*, amount=*)
    cpdef commit(self, state, Hit hit)
    cpdef double expires_at(self, state) except? -1.0
