from cpython.object cimport PyObject

from sidecar.store.records cimport Namer


cdef enum:
    PREFIX_SETS = 32  # 2 ** 5: the set is the address's mixed top 5 bits
    PREFIXES = 2 * PREFIX_SETS  # prefixes whose code and text are kept


cdef class FastNamer(Namer):
    cdef PyObject *_prefixes[PREFIXES]
    cdef PyObject *_known[PREFIXES]

    cdef bytes _digest_of(self, const void *data, Py_ssize_t length)
    cdef tuple _prefix_of(self, tuple key)
