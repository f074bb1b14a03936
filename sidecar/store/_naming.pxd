from cpython.object cimport PyObject

from sidecar.store.records cimport Namer


cdef class FastNamer(Namer):
    cdef PyObject *_prefixes[64]
    cdef PyObject *_known[64]
    cdef size_t _replaced  # the way a prefix not kept takes next, when none is empty

    cdef bytes _digest_of(self, const void *data, Py_ssize_t length)
    cdef tuple _prefix_of(self, tuple key)
