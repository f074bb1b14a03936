# Types of sidecar/store/records.py for its compiled build (see setup.py):
# the states' bytes written and read with few Python calls.
cimport cython

from sidecar.limiters.leaky cimport LeakyState
from sidecar.limiters.token cimport TokenState
from sidecar.limiters.window cimport WindowState

@cython.locals(window=WindowState, token=TokenState, leaky=LeakyState)
cpdef bytes encode_state(state, Py_ssize_t lease_slots)
@cython.locals(kind=int)
cpdef decode_state(bytes value, limiter)

cpdef bytes digest_of(bytes text)
@cython.locals(known=tuple)
cpdef tuple prefix_of(key)
@cython.locals(text=bytes)
cpdef tuple key_name(key)
