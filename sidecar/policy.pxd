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


cdef class TableInC:
    cpdef state(self, key)
    cpdef keep(self, key, state)
    cpdef expect(self, checks)
    cpdef ban(self, address)
    cpdef bint catch_up(self) except -1
    cpdef Evaluation decide(self, policy, double now, address, checks, bint can_delay, bint quotas)


@cython.final
cdef class _CalledByName(TableInC):
    cdef object table


@cython.locals(states=StateMap)
cdef inline void _keep(states, TableInC in_c, key, state, Algorithm limiter) except *


cdef class Policy:
    cdef readonly object table
    cdef public object node
    cdef public object wall_clock
    cdef StateMap _map
    cdef TableInC _in_c

    @cython.locals(check=Check, spec=CheckSpec, evaluation=Evaluation, stopped=bint, hits=list, deferred=list,
                   stored=bint, hit=Hit, limiter=Algorithm, bucket=Algorithm, states=StateMap,
                   in_c=TableInC)
    cpdef Evaluation evaluate(self, double now, address, checks, bint can_delay=*, bint quotas=*)
