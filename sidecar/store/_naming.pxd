from sidecar.store.records cimport Namer


cdef class FastNamer(Namer):
    cdef bytes _digest_of(self, const void *data, Py_ssize_t length)
