# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""A prototype, not the product: ten sliding-window rules decided in C over
a table of fixed records, with no Python object made per key. What a C path
for the common check would cost at its core, under rotation and without it
(bench/bench_proto.py measures it).

- A key is its rule's number and its dimensions' values, hashed as they are
  read (a 128-bit multiply-mix of 8-byte words: a prototype's hash, not a
  keyed one); a new key's first value (the client) is copied beside its
  record, as a store would keep a key's text for its listings.
- The table is open addressing over a power of two of records, twice the
  keys it holds. A key probes 16 records at most (``probes``, fewer for a
  leaner table: a new key reads every record of its probe); when the table
  is full, or no record of its probe is free, it takes an expired record
  of its probe, else the least recently used one (an approximate LRU, as a
  zone's stripe is exact).
- Each record is a sliding window counter: its window's number, the last
  window's count and the current one's, when it was last used and when it
  expires.
"""

from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE

cdef enum:
    PROBES = 16
    TEXT_ROOM = 24  # bytes of a key's text kept in its record
    DIMENSIONS = 6  # client, api key, path, host, q, session

cdef struct Record:
    uint64_t h1
    uint64_t h2
    int64_t window
    double used
    double expires
    int previous
    int current
    unsigned char text[TEXT_ROOM]

# The ten rules: which dimensions each key holds (a bit per dimension), as
# bench_engine's ten rules key them.
cdef int RULE_DIMENSIONS[10]
RULE_DIMENSIONS[:] = [1, 1 | 2, 1, 1, 1, 1, 1 | 4, 8 | 1, 1 | 16, 32]


cdef extern from *:
    """
    #include <stdint.h>
    static inline uint64_t proto_mix(uint64_t a, uint64_t b) {
        unsigned __int128 product = (unsigned __int128)a * b;
        return (uint64_t)product ^ (uint64_t)(product >> 64);
    }
    """
    uint64_t proto_mix(uint64_t a, uint64_t b) nogil


cdef extern from *:
    void __builtin_prefetch(const void *address) nogil


cdef inline uint64_t _mix(uint64_t a, uint64_t b) noexcept nogil:
    return proto_mix(a, b)


cdef inline void _hash_into(uint64_t *h1, uint64_t *h2, const unsigned char *data, Py_ssize_t length) noexcept nogil:
    cdef uint64_t word
    cdef Py_ssize_t at = 0
    while at + 8 <= length:
        memcpy(&word, data + at, 8)
        h1[0] = _mix(h1[0] ^ word, 0x9E3779B97F4A7C15)
        h2[0] = _mix(h2[0] ^ word, 0xC2B2AE3D27D4EB4F)
        at += 8
    word = <uint64_t>length << 56
    if at < length:
        memcpy(&word, data + at, length - at)
        word ^= <uint64_t>length << 56
    h1[0] = _mix(h1[0] ^ word, 0x9E3779B97F4A7C15)
    h2[0] = _mix(h2[0] ^ word, 0xC2B2AE3D27D4EB4F)


cdef class Table:
    cdef Record *records
    cdef uint64_t mask
    cdef Py_ssize_t count, max_keys
    cdef int probes
    cdef public Py_ssize_t evictions

    def __cinit__(self, Py_ssize_t max_keys, int probes=PROBES):
        cdef uint64_t size = 1
        while size < <uint64_t>(2 * max_keys):
            size <<= 1
        self.records = <Record *>calloc(size, sizeof(Record))
        if self.records == NULL:
            raise MemoryError()
        self.mask = size - 1
        self.max_keys = max_keys
        self.probes = max(1, min(probes, PROBES))

    def __dealloc__(self):
        free(self.records)

    cdef Record *_find(self, uint64_t h1, uint64_t h2, double now, const unsigned char *text,
                       Py_ssize_t length) noexcept:
        """The key's record; a new key takes a free record of its probe, else
        an expired one, else the least recently used one, and its text is
        copied beside the record (what a listing of the keys would read)."""
        cdef Record *record
        cdef Record *oldest = NULL
        cdef Record *free_record = NULL
        cdef int probe
        if h1 == 0 and h2 == 0:
            h1 = 1
        for probe in range(self.probes):
            record = &self.records[(h1 + probe) & self.mask]
            if record.h1 == h1 and record.h2 == h2:
                record.used = now
                return record
            if record.h1 == 0 and record.h2 == 0:
                if free_record == NULL:
                    free_record = record
            elif oldest == NULL or (record.expires < now) > (oldest.expires < now) or (
                    (record.expires < now) == (oldest.expires < now) and record.used < oldest.used):
                oldest = record
        if free_record != NULL and self.count < self.max_keys:
            record = free_record
            self.count += 1
        else:
            record = oldest if oldest != NULL else free_record
            self.evictions += 1
        record.h1, record.h2 = h1, h2
        record.window, record.previous, record.current, record.used = 0, 0, 0, now
        memcpy(record.text, text, min(length, TEXT_ROOM))
        return record

    def decide(self, bytes client, bytes api_key, bytes path, bytes host, bytes query, bytes session,
               double now, double period, int threshold):
        """Whether the request is within all ten rules' limits; each rule's
        key counted (a refusal counts nothing, as the engine does). The
        keys' records are read one after the other."""
        return self._decide((client, api_key, path, host, query, session), now, period, threshold, False)

    def decide_overlapped(self, bytes client, bytes api_key, bytes path, bytes host, bytes query,
                          bytes session, double now, double period, int threshold):
        """``decide``, the ten keys hashed and their probes' memory asked
        for before the first is read."""
        return self._decide((client, api_key, path, host, query, session), now, period, threshold, True)

    cdef bint _decide(self, tuple fields, double now, double period, int threshold, bint overlapped):
        cdef const unsigned char *values[DIMENSIONS]
        cdef Py_ssize_t lengths[DIMENSIONS]
        cdef uint64_t first[10]
        cdef uint64_t second[10]
        cdef Record *found[10]
        cdef int rule, dimension, probe
        cdef int64_t window = <int64_t>(now / period)
        cdef double elapsed = now / period - window, estimate
        cdef Record *record
        for dimension in range(DIMENSIONS):
            values[dimension] = <const unsigned char *>PyBytes_AS_STRING(fields[dimension])
            lengths[dimension] = PyBytes_GET_SIZE(fields[dimension])
        for rule in range(10):
            first[rule] = 0x243F6A8885A308D3 + rule
            second[rule] = 0x13198A2E03707344 + rule
            for dimension in range(DIMENSIONS):
                if RULE_DIMENSIONS[rule] & (1 << dimension):
                    _hash_into(&first[rule], &second[rule], values[dimension], lengths[dimension])
            if overlapped:
                for probe in range(self.probes):
                    __builtin_prefetch(&self.records[(first[rule] + probe) & self.mask])
        for rule in range(10):
            record = self._find(first[rule], second[rule], now, values[0], lengths[0])
            if record.window != window:
                record.previous = record.current if record.window == window - 1 else 0
                record.current = 0
                record.window = window
                record.expires = (window + 2) * period
            estimate = record.previous * (1.0 - elapsed) + record.current
            if estimate + 1 > threshold:
                return False
            found[rule] = record
        for rule in range(10):
            found[rule].current += 1
        return True
