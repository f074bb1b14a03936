# Types of sidecar/policy.py for its compiled build (see setup.py): the
# policy is an extension type, its loop over a request's checks typed (its
# limiters' methods called in C).
cimport cython

from sidecar.limiters.records cimport Algorithm, Hit, refused
from sidecar._statemap cimport StateMap
from sidecar.keystate cimport limiter_of
from sidecar.state cimport Check, CheckSpec, Evaluation


@cython.locals(evaluation=Evaluation)
cpdef Evaluation evaluated(list hits)


@cython.locals(states=StateMap)
cdef inline void _keep(states, keep, key, state, Algorithm limiter) except *


cdef class Policy:
    cdef readonly object table
    cdef public object node
    cdef public object wall_clock
    cdef StateMap _map

    @cython.locals(check=Check, spec=CheckSpec, evaluation=Evaluation, stopped=bint, hits=list, deferred=list,
                   stored=bint, hit=Hit, limiter=Algorithm, bucket=Algorithm, states=StateMap)
    cpdef Evaluation evaluate(self, double now, address, checks, bint can_delay=*, bint quotas=*)
