# Types of sidecar/state.py for its compiled build (see setup.py): what a
# request asks of the store (its checks, each rule's spec) and what the
# store answers (the evaluation) are extension types. The .py stays the
# reference and the pure-Python core.
cimport cython

from sidecar.limiters.records cimport Algorithm

cdef double _EPOCH_OFFSET
cdef object _monotonic


cdef class CheckSpec:
    cdef readonly object rule_id
    cdef readonly Algorithm limiter  # every limiter is one (sidecar.limiters.records): read in C, no type test
    cdef readonly object threshold
    cdef readonly bint stops
    cdef readonly object ban_duration
    cdef readonly bint count
    cdef readonly object auto_ban
    cdef readonly object amount
    cdef readonly object ban_increment
    cdef readonly object penalty_ban
    cdef readonly bint plain
    cdef public bint deferred  # set in __post_init__ (object.__setattr__)
    cdef public bint leases  # the same


cdef class Check:
    cdef public CheckSpec spec
    cdef public object key
    cdef public object lease


@cython.locals(check=Check)
cpdef add_check(list matched, list checks, rule, CheckSpec spec, key, lease)


cdef class Evaluation:
    cdef public object ban
    cdef public bint new_ban
    cdef public list hits
    cdef public double delay
    cdef public object quotas

