# Types of sidecar/latency.py for its compiled build (see setup.py).
cimport cython


cdef class LatencyHistogram:
    cdef public list counts
    cdef public double total
    cdef public long long count

    @cython.locals(index=Py_ssize_t, bound=double)
    cpdef void observe(self, double seconds)


cdef class Tally:
    cdef public long long value

    cpdef void inc(self, long long amount=*)


cdef class RuleSetCount:
    cdef public long long value
    cdef public bint live
