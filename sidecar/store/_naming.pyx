# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The node's table's names, worked out in C: ``FastNamer`` is
``sidecar.store.records.Namer`` (its pure twin and reference) with its
digests and its common keys' texts made without a Python object between
the key and its name.

Under a rotation of clients every key a check reads is one the worker
has not named yet, and naming it was a third of a rotating check's
instructions over the node's table: the key's text built by five
concatenations of texts and an encoding, then SipHash over it with its
words in an object made for each digest and the text read a byte at a
time. Here a plain key (one or two texts of printable ASCII without a
quote or a backslash: nearly every key) is written straight into the
bytes of its text, and SipHash-2-4 runs on C words read eight bytes at
a time. Any other key is named by ``Namer``'s own code. The names are the
same bytes as ``Namer``'s (a property test holds them to it)."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from libc.stdint cimport uint64_t
from libc.string cimport memcpy

from sidecar._statemap cimport unchanging
from sidecar.store.records cimport Namer, prefix_of


cdef extern from *:
    """
    /* SipHash-2-4 with its 128-bit output (Aumasson and Bernstein), its
       message words read little-endian on any host. */
    #include <stdint.h>
    #include <string.h>

    #define SLUICE_ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))

    static inline uint64_t sluice_word_le(const unsigned char *p) {
        return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) | ((uint64_t)p[3] << 24)
            | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) | ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
    }

    static inline void sluice_sip_rounds(uint64_t *v, int count) {
        int turn;
        for (turn = 0; turn < count; turn++) {
            v[0] += v[1]; v[1] = SLUICE_ROTL(v[1], 13); v[1] ^= v[0]; v[0] = SLUICE_ROTL(v[0], 32);
            v[2] += v[3]; v[3] = SLUICE_ROTL(v[3], 16); v[3] ^= v[2];
            v[0] += v[3]; v[3] = SLUICE_ROTL(v[3], 21); v[3] ^= v[0];
            v[2] += v[1]; v[1] = SLUICE_ROTL(v[1], 17); v[1] ^= v[2]; v[2] = SLUICE_ROTL(v[2], 32);
        }
    }

    static inline void sluice_siphash128(uint64_t k0, uint64_t k1, const unsigned char *data, size_t length,
                                         unsigned char *out) {
        uint64_t v[4];
        uint64_t word, parts[2];
        size_t at = 0, left, shift;
        int half, index;
        v[0] = k0 ^ 0x736F6D6570736575ULL;
        v[1] = k1 ^ 0x646F72616E646F6DULL ^ 0xEE;
        v[2] = k0 ^ 0x6C7967656E657261ULL;
        v[3] = k1 ^ 0x7465646279746573ULL;
        for (; at + 8 <= length; at += 8) {
            word = sluice_word_le(data + at);
            v[3] ^= word;
            sluice_sip_rounds(v, 2);
            v[0] ^= word;
        }
        word = ((uint64_t)(length & 0xFF)) << 56;
        left = length - at;
        for (shift = 0; shift < left; shift++)
            word |= ((uint64_t)data[at + shift]) << (8 * shift);
        v[3] ^= word;
        sluice_sip_rounds(v, 2);
        v[0] ^= word;
        v[2] ^= 0xEE;
        sluice_sip_rounds(v, 4);
        parts[0] = v[0] ^ v[1] ^ v[2] ^ v[3];
        v[1] ^= 0xDD;
        sluice_sip_rounds(v, 4);
        parts[1] = v[0] ^ v[1] ^ v[2] ^ v[3];
        for (half = 0; half < 2; half++)
            for (index = 0; index < 8; index++)
                out[8 * half + index] = (unsigned char)(parts[half] >> (8 * index));
    }
    """
    void sluice_siphash128(uint64_t k0, uint64_t k1, const unsigned char *data, size_t length,
                           unsigned char *out) noexcept nogil


cdef extern from "Python.h":
    bint PyUnicode_IS_COMPACT_ASCII(object text)
    void *PyUnicode_DATA(object text)
    Py_ssize_t PyUnicode_GET_LENGTH(object text)


cdef enum:
    DIGEST_BYTES = 16  # SipHash's 128 bits (records.DIGEST_BYTES)


cdef inline bint _plain(object value) noexcept:
    """``records._plain``: a text of printable ASCII without a quote or a
    backslash (so in one byte a character, as Python keeps ASCII)."""
    cdef const unsigned char *data
    cdef Py_ssize_t index, length
    cdef unsigned char byte
    if type(value) is not str or not PyUnicode_IS_COMPACT_ASCII(value):
        return False
    data = <const unsigned char *>PyUnicode_DATA(value)
    length = PyUnicode_GET_LENGTH(value)
    for index in range(length):
        byte = data[index]
        if byte < 0x20 or byte > 0x7E or byte == 0x27 or byte == 0x5C:
            return False
    return True


cdef inline unsigned char *_put(unsigned char *at, const char *text, Py_ssize_t length) noexcept:
    memcpy(at, text, length)
    return at + length


cdef class FastNamer(Namer):
    """``Namer``, its digests and its plain keys' texts made in C. A rule's
    keys share its prefix object: its code and text are kept by the
    object's identity (``PREFIXES`` of them, each object held so that no
    other takes its address), where ``records.prefix_of`` hashes the
    prefix's tuples for each key."""

    def __dealloc__(self):
        cdef int slot
        for slot in range(PREFIXES):
            Py_XDECREF(self._prefixes[slot])
            Py_XDECREF(self._known[slot])

    cdef tuple _prefix_of(self, tuple key):
        """``records.prefix_of(key)``: (code, text) of the key's prefix,
        kept by its identity as the compiled map keeps a prefix's hash
        (``sidecar._statemap._prefix_hash``): two a set, the set picked by
        the address's bits mixed (blocks of one pool apart would share the
        set of their low bits), the newest first; only a prefix whose value
        cannot change (texts, tuples of them)."""
        cdef object prefix = key[0]
        cdef size_t slot = 2 * <size_t>((<uint64_t><size_t><PyObject *>prefix * 0x9E3779B97F4A7C15ULL) >> 59)
        cdef tuple known
        cdef PyObject *second
        cdef PyObject *second_known
        if self._prefixes[slot] == <PyObject *>prefix:
            return <tuple>self._known[slot]
        if self._prefixes[slot + 1] == <PyObject *>prefix:
            return <tuple>self._known[slot + 1]
        known = prefix_of(key)
        if unchanging(prefix):
            # The newest first in its set, the other one second; the one
            # that was second goes, once the set holds the new one (what
            # its deallocation runs finds the namer whole).
            second, second_known = self._prefixes[slot + 1], self._known[slot + 1]
            self._prefixes[slot + 1], self._known[slot + 1] = self._prefixes[slot], self._known[slot]
            Py_INCREF(prefix)
            Py_INCREF(known)
            self._prefixes[slot], self._known[slot] = <PyObject *>prefix, <PyObject *>known
            Py_XDECREF(second)
            Py_XDECREF(second_known)
        return known

    cdef bytes _digest_of(self, const void *data, Py_ssize_t length):
        cdef bytes digest = PyBytes_FromStringAndSize(NULL, DIGEST_BYTES)
        sluice_siphash128(self.k0, self.k1, <const unsigned char *>data, <size_t>length,
                          <unsigned char *>PyBytes_AS_STRING(digest))
        return digest

    cpdef bytes digest(self, bytes text):
        if text is None:
            return Namer.digest(self, text)  # refused as Namer refuses it
        return self._digest_of(PyBytes_AS_STRING(text), PyBytes_GET_SIZE(text))

    cpdef tuple key_name(self, key):
        """``Namer.key_name``: (text, digest, prefix text); a key of one or
        two plain texts written here, any other by ``Namer``."""
        cdef tuple counting, known
        cdef object first, second = None
        cdef Py_ssize_t count, size
        cdef bytes code, text
        cdef unsigned char *at
        if type(key) is not tuple:
            return Namer.key_name(self, key)
        counting = <tuple>key
        count = len(counting)
        if count != 2 and count != 3:
            return Namer.key_name(self, key)
        first = counting[1]
        if not _plain(first):
            return Namer.key_name(self, key)
        if count == 3:
            second = counting[2]
            if not _plain(second):
                return Namer.key_name(self, key)
        known = self._prefix_of(counting)
        code = <bytes>known[0]
        # "('first',)" or "('first', 'second')", after the prefix's code.
        size = PyBytes_GET_SIZE(code) + 2 + PyUnicode_GET_LENGTH(first)
        size += 3 if count == 2 else 6 + PyUnicode_GET_LENGTH(second)
        text = PyBytes_FromStringAndSize(NULL, size)
        at = <unsigned char *>PyBytes_AS_STRING(text)
        at = _put(at, PyBytes_AS_STRING(code), PyBytes_GET_SIZE(code))
        at = _put(at, "('", 2)
        at = _put(at, <const char *>PyUnicode_DATA(first), PyUnicode_GET_LENGTH(first))
        if count == 2:
            _put(at, "',)", 3)
        else:
            at = _put(at, "', '", 4)
            at = _put(at, <const char *>PyUnicode_DATA(second), PyUnicode_GET_LENGTH(second))
            _put(at, "')", 2)
        return text, self._digest_of(PyBytes_AS_STRING(text), size), known[1]

    cpdef bytes ban_name(self, str address):
        """``Namer.ban_name``: an ASCII address (every valid one) hashed
        where the text keeps it, any other encoded first."""
        if address is not None and PyUnicode_IS_COMPACT_ASCII(address):
            return self._digest_of(PyUnicode_DATA(address), PyUnicode_GET_LENGTH(address))
        return Namer.ban_name(self, address)
