# Types of sidecar/store/records.py for its compiled build (see setup.py):
# the states' bytes written and read with few Python calls.
cimport cython

cpdef bytes encode_state(state, Py_ssize_t lease_slots)
@cython.locals(kind=int)
cpdef decode_state(bytes value, limiter)

cpdef bytes digest_of(bytes text)
@cython.locals(known=tuple)
cpdef tuple prefix_of(key)
@cython.locals(text=bytes)
cpdef tuple key_name(key)
