# Types of sidecar/limiters/records.py for its compiled build (see setup.py):
# a limiter's answer is an extension type, made without a call of its class.
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
