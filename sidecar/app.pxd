# Types of sidecar/app.py for its compiled build (see setup.py): the check
# doors are extension types, the fields a check reads C fields; the rest
# of the module is compiled as it is written.
cimport cython

from sidecar.latency cimport LatencyHistogram


cdef class CheckDoor:
    cdef public object app
    cdef public object engine
    cdef public object check
    cdef public object front_door
    cdef public dict decisions
    cdef public LatencyHistogram latency
    cdef public object refusals
    cdef public bint stores
    cdef public bint chains
    cdef public object tracing


cdef class AtOnceDoor(CheckDoor):
    cdef public object at_once
    cdef public object decide

    cpdef reply(self, dict scope, dict headers)


cdef class AwaitedDoor(CheckDoor):
    pass
