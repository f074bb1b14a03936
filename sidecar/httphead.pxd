# Types of sidecar/httphead.py for its compiled build (see setup.py): the
# head read byte by byte in C, each byte a C integer.
cimport cython


cdef bint is_token(unsigned char byte)
cdef bint is_target(unsigned char byte)
cdef bint is_value(unsigned char byte)

cdef dict _NAMES
cdef list _LAST_NAMES

cpdef Py_ssize_t names_kept()

@cython.locals(end=Py_ssize_t, position=Py_ssize_t, target_start=Py_ssize_t, target_end=Py_ssize_t,
               path_end=Py_ssize_t, path=str, query=bytes,
               name_start=Py_ssize_t, value_start=Py_ssize_t, value_end=Py_ssize_t,
               count=Py_ssize_t, fields=dict, text=str, sent=str, known=str, last=tuple,
               sent_name=bytes)
cpdef tuple read_head(bytes data, Py_ssize_t start, Py_ssize_t max_headers)

cpdef list field_list(dict fields)
