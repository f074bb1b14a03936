# Types of sidecar/store/records.py for its compiled build (see setup.py):
# the states' bytes written and read with few Python calls.
cimport cython

from sidecar.limiters.leaky cimport LeakyState
from sidecar.limiters.token cimport TokenState
from sidecar.limiters.window cimport WindowState

@cython.locals(bits="unsigned long long", shift=int)
cdef void _put_word(unsigned char *written, Py_ssize_t at, long long word) noexcept
@cython.locals(bits="long long")
cdef long long _double_word(double value) noexcept
@cython.locals(size=Py_ssize_t, tail=Py_ssize_t, at=Py_ssize_t, space="const char *", value=bytes,
               written="unsigned char *", copied="const unsigned char *")
cdef bytes _state_bytes(int kind, int count, long long first, long long second, long long third,
                        long long fourth, bytes text, Py_ssize_t room, int flags)
cdef int _placed(Py_ssize_t size, bytes text, Py_ssize_t room, int flags) except -1
cdef Py_ssize_t _following(bytes text, Py_ssize_t room, int flags) except -1
cdef bytes _in_record(bytes value, bytes text, Py_ssize_t room, int flags)
@cython.locals(window=WindowState, token=TokenState, leaky=LeakyState)
cpdef bytes encode_state(state, Py_ssize_t lease_slots, bytes text=*, Py_ssize_t room=*, int flags=*)
@cython.locals(kind=int)
cpdef decode_state(bytes value, limiter)

@cython.locals(known=tuple, prefixes=dict)
cpdef tuple prefix_of(key)
@cython.locals(pieces=list, count=Py_ssize_t, first=str, second=str)
cpdef bytes values_text(tuple key)
@cython.locals(text=str, char=Py_UCS4)
cdef bint _plain(value) except -1
@cython.locals(index=Py_ssize_t)
cdef bint _repr_into(tuple values, Py_ssize_t first, list pieces) except -1

cdef unsigned long long _MASK64, _SIP0, _SIP1, _SIP2, _SIP3
cdef Py_ssize_t _SPACE_SIZE
cdef int _ELSEWHERE_BIT


@cython.final
cdef class _SipState:
    cdef unsigned long long v0, v1, v2, v3

    @cython.locals(v0="unsigned long long", v1="unsigned long long", v2="unsigned long long",
                   v3="unsigned long long", turn=int)
    cdef void rounds(self, int count) noexcept


@cython.locals(state=_SipState, raw="const unsigned char *", length=Py_ssize_t, start=Py_ssize_t, take=Py_ssize_t,
               shift=Py_ssize_t, word="unsigned long long", byte="unsigned long long", last="unsigned long long",
               first="unsigned long long", second="unsigned long long", digest=bytes,
               space="const char *")
cpdef bytes siphash128(unsigned long long k0, unsigned long long k1, bytes data)


cdef class Namer:  # not final: sidecar.store._naming's FastNamer is it, in C
    cdef readonly unsigned long long k0, k1

    cpdef bytes digest(self, bytes text)
    @cython.locals(text=bytes)
    cpdef tuple key_name(self, key)
    cpdef bytes ban_name(self, str address)
    cpdef bytes note_name(self, name)
