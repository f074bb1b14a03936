# Types of sidecar/store/memory.py for its compiled build (see setup.py):
# the table is an extension type, its maps C fields (the bans read for
# every check in C).
cimport cython

from sidecar.bounded cimport BoundedMap


cdef class MemoryTable:
    cdef public object states
    cdef public BoundedMap bans
    cdef public dict notes
    cdef public object state
    cdef public object keep
    cdef public object expect

    @cython.locals(bans=BoundedMap)
    cpdef ban(self, address)
