# Declarations of sidecar/_statemap.pyx: the map and its record, which
# the compiled policy cimports to call the map's reads and writes in C
# (sidecar.policy).
cimport cython
from cpython.object cimport PyObject
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t


cdef enum:
    NONE = -1  # no record: the end of a list
    # Making room: the records of the recency ring's next entries whose
    # memory is asked for ahead, and of those, the ones whose keys, states
    # and index entries are asked for too (their records read by then).
    FETCHED_AHEAD = 32
    OPENED_AHEAD = 16
    DEEP_AHEAD = 8  # of those, the ones whose states' objects are asked for too
    SPARES_AHEAD = 4  # free records asked for ahead of their use
    FIRST_RECORDS = 64  # records allocated at first
    # Slots found without the wheel's dict (a power of 2): a slot is a
    # second, so that the slots of records stored an hour ago (and evicted
    # now under a rotation) are found as those just filed are.
    RECENT_SLOTS = 4096
    MOST_ITEMS = 3  # a tuple key of up to this many items is kept as its items
    MOST_EXPECTED = 32  # keys of one request whose memory ``expect`` asks for ahead
    # Keys from which ``expect`` asks (256 KiB of records): a smaller map
    # stays in the CPU's nearer caches, and the hint would only cost.
    EXPECTED_FROM = 4096
    LINE = 64  # bytes of a line of memory (x86-64's, arm64's): a record's size


# 64 bytes on a 64-bit machine: a line of memory, as ``_grow`` aligns them.
cdef bint unchanging(object value) noexcept


cdef struct Record:
    # The key, or a short tuple key's items (``items`` of them); parts[0]
    # NULL: a free record (its ``newer`` links the free list).
    PyObject *parts[MOST_ITEMS]
    PyObject *value
    long long slot  # the wheel slot it is filed under
    uint32_t tag  # the top 32 bits of its key's mixed hash, as in its index entry
    # Its entry's stamp in the recency ring: changed when it is made the
    # newest or dropped, so that its earlier entries are stale.
    uint32_t stamp
    int32_t wheel_prev  # its wheel slot's list
    int32_t wheel_next
    uint8_t items  # a tuple key's items kept in ``parts``; 0: parts[0] is the whole key
    uint8_t used  # read since stored or last passed over (the pure map's state.used)


@cython.final
cdef class StateMap:
    cdef public Py_ssize_t max_keys
    cdef public Py_ssize_t expect_from  # EXPECTED_FROM; the tests lower it
    cdef object _clock
    cdef Record *_records  # aligned to a line of memory (LINE) within _block
    cdef void *_block
    cdef int32_t _allocated  # records allocated
    cdef int32_t _count  # live records
    cdef int32_t _untouched  # records never used yet: _untouched .. _allocated - 1
    # Free records (dropped ones, to be used again), the last freed last.
    cdef int32_t *_spare
    cdef int32_t _spares
    # The recency ring: an entry (stamp << 32 | record's number) each time
    # a record is made the newest, oldest first from _tail to _head; an
    # entry whose stamp is no longer its record's is stale. Twice as many
    # entries as records.
    cdef uint64_t *_ring
    cdef Py_ssize_t _ring_size
    cdef Py_ssize_t _tail
    cdef Py_ssize_t _head
    # The index: 2 ** _bits entries, each 0 (empty) or the key's mixed hash's
    # top 32 bits << 32 | its record's number + 1.
    cdef uint64_t *_index
    cdef int _bits
    cdef dict _wheel  # slot -> _Slot
    cdef list _slots  # heap of the wheel's slots (some may be gone: skipped)
    # Slots filed into lately, each at its number modulo RECENT_SLOTS (or
    # None): the rules' few periods make few slots a second, and two held
    # at once share an entry only when their seconds differ by a multiple
    # of RECENT_SLOTS.
    cdef list _recent
    # The key the last ``get`` did not find, and its hash: the policy
    # stores a new key right after reading it, and ``add`` then neither
    # hashes it nor looks for it again. Any ``add`` forgets it.
    cdef object _missed
    cdef uint64_t _missed_hash
    # The keys ``expect`` or ``hint`` hashed (references held until the next
    # request's are) and their mixed hashes: ``get`` takes the next one's
    # hash when it is read next, in the checks' order, instead of hashing
    # it again.
    cdef PyObject *_expected[MOST_EXPECTED]
    cdef uint64_t _expected_hash[MOST_EXPECTED]
    cdef int _expected_count
    cdef int _expected_next

    cdef int _grow(self, Py_ssize_t wanted) except -1
    cdef inline size_t _home(self, uint64_t hashed) noexcept
    cdef inline void _place(self, uint64_t hashed, int32_t number) noexcept
    cdef inline size_t _entry_of(self, int32_t number) noexcept
    cdef Py_ssize_t _find(self, key, uint64_t hashed) except -2
    cdef int _holds_items(self, Record *record, key) except -1
    cdef object _key(self, Record *record)
    cdef void _keep_key(self, Record *record, key) noexcept
    cdef inline void _release(self, Record record) noexcept
    cdef inline void _unplace(self, size_t at) noexcept
    cdef inline void _link_newest(self, int32_t number) noexcept
    cdef void _compact(self) noexcept
    cdef inline int _file(self, int32_t number, double expires) except -1
    cdef inline int _unfile(self, int32_t number) except -1
    cdef inline int _drop(self, int32_t number, size_t at) except -1
    cdef inline int _drop_key(self, int32_t number) except -1
    cdef inline int32_t _new_record(self) except -1
    cdef inline int32_t _number(self, Py_ssize_t at) noexcept
    cdef int _replace(self, int32_t number, value, double expires) except -1
    cdef inline bint takes_hints(self) noexcept:
        """Whether ``hint`` and ``expect`` ask for memory (the map holds
        ``expect_from`` keys or more)."""
        return self._count >= self.expect_from
    cpdef hint(self, key, Py_ssize_t position)
    cdef int _keep_expected(self, int index, key) except -1
    cpdef expect(self, checks)
    cdef void _forget_expected(self) noexcept
    cdef int _hinted(self, checks, Py_ssize_t count) except -1
    cdef uint64_t _hash_of(self, key) except? 0
    cpdef get(self, key)
    cpdef add(self, key, value, expires=*)
    cdef int store(self, key, value, double expires) except -1
    cdef int _make_room(self) except -1
    cdef int _drop_oldest(self, Py_ssize_t count) except -1
