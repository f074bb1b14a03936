# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled map of the counting keys' states: ``sidecar.bounded.StateMap``
(read its docstring first) over a table of C records instead of a dict and
lists of keys.

What it keeps is the pure map's, and so is every choice it makes: a read
marks the key (in its record here, not on the state: ``marked``); when
full, the keys of past expiry slots that have expired go, then the oldest
unread keys, a hundredth of the map, a read one moved to the newest end
instead, its mark cleared. The property tests hold the two to the same
contents in the same order after any operations.

How it keeps it differs, for a rotation of new keys (an attack through
many addresses), where the pure map spends most of its time:

- each key is a record in one array: its hash's top bits, key, state,
  read mark, recency stamp and its wheel slot's links, by index;
- a key that is a tuple of two or three items (a rule's prefix and one or
  two values, such as an address: nearly every counting key) is kept as
  its items, not as the tuple, and ``items`` makes the tuple again when
  asked. Under rotation the tuple was one more object a key to allocate
  and, when the key went, two more lines of memory to read (its counts
  and the collector's header);
- the recency ring stands for the dict's order: an array of entries, one
  added at its head each time a record is made the newest (its stamp and
  number), oldest first from its tail; a record's earlier entries are
  stale (their stamp is no longer the record's) and passed over. Making
  room reads the ring in order and so knows the records ahead without
  reading them: under rotation a linked list's walk waited for each
  record's line of memory in turn, to learn the next (more than half of
  the time making room took);
- each slot of the expiry wheel is a list of its records: a record is
  unlinked when its key goes, so the wheel holds no stale reference, never
  needs a rebuild, and making room never hashes a key again;
- the index is open addressing with linear probing over the records, each
  entry a record's number and the high bits of its key's hash, so a probe
  reads a record only when the bits match; a removal shifts the probe's
  later entries back instead of leaving a tombstone.

A key is hashed as Python hashes it, with the hash of its prefix (a
rule's id and its dimensions' names, the tuple that begins every key of
the rule) kept instead of worked out again for every key (``key_hash``).

A request's keys are read one after the other, each read waiting for its
lines of memory when many clients' keys have pushed them out of the CPU's
cache. ``expect``, the policy's hint of the keys it reads next, asks for
them all at once instead (``StateTable.expect``); ``hint``, the matching
program's of each key as it makes the key's check, asks for its index
entry earlier still, while the next rules are matched.

Records are allocated as needed (doubling, up to ``max_keys``), never
beyond what the map has held at once, through Python's raw allocator
(tracemalloc counts them), each record a line of memory of 64 bytes (the
array aligned to one: a record read is one line, not two); a smaller
``max_keys`` applies at the next insertion, as in the pure map. Making
room asks for the memory of the next records to drop before it drops them
(``_drop_oldest``); a new key takes the record freed last (the most likely
to be in the cache still), the memory of the one ``SPARES_AHEAD`` below
it on the stack asked for.
"""

cimport cython
from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc
from cpython.object cimport Py_EQ, PyObject, PyObject_Hash, PyObject_RichCompareBool, PyTypeObject
from cpython.ref cimport Py_DECREF, Py_INCREF, Py_XDECREF
from cpython.unicode cimport PyUnicode_CheckExact, PyUnicode_DATA, PyUnicode_GET_LENGTH, PyUnicode_KIND
from cpython.tuple cimport (
    PyTuple_Check, PyTuple_CheckExact, PyTuple_GET_ITEM, PyTuple_GET_SIZE, PyTuple_New, PyTuple_SET_ITEM,
)
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcmp, memcpy, memmove, memset

import heapq

from sidecar.bounded cimport state_expiry, wheel_slot
from sidecar.limiters.leaky cimport LeakyState
from sidecar.limiters.token cimport TokenState
from sidecar.state cimport Check


cdef extern from *:
    # GCC's and Clang's: ask for a line of memory before it is read.
    void prefetch "__builtin_prefetch"(const void *address) noexcept nogil
    PyTypeObject *type_of "Py_TYPE"(PyObject *value) noexcept nogil


# An index entry's halves: the tag (the hash's top bits) and the record's number + 1.
cdef uint64_t TAG_BITS = (<uint64_t>0xFFFFFFFF) << 32
cdef uint64_t NUMBER_BITS = <uint64_t>0xFFFFFFFF


cdef object NOTHING = object()  # no key missed (a key may be None)


cdef enum:
    # The bytes past its start that reading a key's text reaches: its
    # header (48 bytes for a compact text) and a client's key (an address,
    # an IPv6 /64 network) at most.
    TEXT_REACH = 72


cdef inline void prefetch_text(PyObject *value) noexcept:
    """Ask for the memory of a key's item: its first line, and the next
    when it reaches into one. Python's allocator puts a text of 64 bytes
    (an IPv4 address's) 48 bytes into a line, so its header's end and its
    characters (which a comparison reads, and its deallocation's look at
    its state) are in the line after the one it starts in."""
    prefetch(value)
    prefetch(<char *>value + TEXT_REACH - 1)


cdef inline void prefetch_fields(PyObject *state) noexcept:
    """Ask for the memory of the objects a bucket's state holds (the
    leaky bucket's excess and time, Python integers; the token bucket's
    time), which its deallocation reads; a window state holds none. Read
    once the state's own line is in the cache."""
    if state == NULL:
        return
    if type_of(state) == <PyTypeObject *>LeakyState:
        prefetch(<void *>(<LeakyState>state).excess)
        prefetch(<void *>(<LeakyState>state).last)
    elif type_of(state) == <PyTypeObject *>TokenState:
        prefetch(<void *>(<TokenState>state).last)


@cython.final
@cython.no_gc
cdef class _Slot:
    """One second of the expiry wheel: its records, first filed first."""
    cdef long long number
    cdef int32_t first
    cdef int32_t last


# The hashes of the prefixes of keys (a rule's id and its dimensions'
# names, a tuple the rule makes once and puts first in each of its keys),
# kept by the prefix object (a reference held, so that no other object
# takes its address), a few of them: hashing a key then hashes its values
# only, not the nested tuple of texts before them, whose memory is then
# not read either. Two a set, so that two prefixes whose addresses fall in
# one set (a ruleset of ten has one such pair about one time in three)
# are both kept, not hashed again in turn.
cdef enum:
    PREFIX_SETS = 128  # 2 ** 7: the set is a hash's top 7 bits
    PREFIXES = 2 * PREFIX_SETS  # prefixes whose hash is kept

cdef PyObject *prefix_objects[PREFIXES]
cdef Py_hash_t prefix_hashes[PREFIXES]
memset(prefix_objects, 0, sizeof(prefix_objects))

# CPython's tuple hash (Objects/tupleobject.c, xxHash's mixing, 64 bits).
cdef uint64_t XXPRIME_1 = 11400714785074694791ULL
cdef uint64_t XXPRIME_2 = 14029467366897019727ULL
cdef uint64_t XXPRIME_5 = 2870177450012600261ULL


cdef bint unchanging(object value) noexcept:
    """Whether ``value``'s hash can never change: a text, or a tuple of
    such values (a prefix is one). Also the compiled namer's
    (``sidecar.store._naming``), which keeps a prefix's names by identity."""
    cdef Py_ssize_t index
    if PyUnicode_CheckExact(value):
        return True
    if not PyTuple_CheckExact(value):
        return False
    for index in range(PyTuple_GET_SIZE(value)):
        if not unchanging(<object>PyTuple_GET_ITEM(value, index)):
            return False
    return True


cdef Py_hash_t _prefix_hash(object prefix) except? -1:
    """``hash(prefix)``, kept for the next keys of the prefix."""
    # The address spread over the slots (Fibonacci hashing): prefixes made
    # one after the other lie a few lines apart.
    cdef size_t slot = 2 * <size_t>((<uint64_t><size_t><PyObject *>prefix * <uint64_t>0x9E3779B97F4A7C15ULL) >> 57)
    cdef Py_hash_t hashed
    if prefix_objects[slot] == <PyObject *>prefix:
        return prefix_hashes[slot]
    if prefix_objects[slot + 1] == <PyObject *>prefix:
        return prefix_hashes[slot + 1]
    hashed = PyObject_Hash(prefix)
    if unchanging(prefix):
        # The newest first in its set, the other one second; the one that
        # was second goes.
        Py_XDECREF(prefix_objects[slot + 1])
        prefix_objects[slot + 1] = prefix_objects[slot]
        prefix_hashes[slot + 1] = prefix_hashes[slot]
        Py_INCREF(prefix)
        prefix_objects[slot] = <PyObject *>prefix
        prefix_hashes[slot] = hashed
    return hashed


cdef bint _same_text(PyObject *one, PyObject *other) noexcept:
    """Whether two exact texts are equal, as CPython finds it
    (``unicode_eq``): the same length, kind and code units."""
    cdef Py_ssize_t length = PyUnicode_GET_LENGTH(<object>one)
    if length != PyUnicode_GET_LENGTH(<object>other) or \
            PyUnicode_KIND(<object>one) != PyUnicode_KIND(<object>other):
        return False
    return memcmp(PyUnicode_DATA(<object>one), PyUnicode_DATA(<object>other),
                  <size_t>length * PyUnicode_KIND(<object>one)) == 0


cdef Py_hash_t key_hash(object key) except? -1:
    """``hash(key)``: for a tuple key whose first item is a tuple (a
    counting key: its prefix, then its values), CPython's tuple hash worked
    out here with the prefix's hash kept (``_prefix_hash``); any other key's
    own hash."""
    cdef Py_ssize_t index, size
    cdef uint64_t accumulated, lane
    cdef Py_hash_t hashed
    if not PyTuple_CheckExact(key):
        return PyObject_Hash(key)
    size = PyTuple_GET_SIZE(key)
    if size == 0 or not PyTuple_CheckExact(<object>PyTuple_GET_ITEM(key, 0)):
        return PyObject_Hash(key)
    accumulated = XXPRIME_5
    for index in range(size):
        if index == 0:
            hashed = _prefix_hash(<object>PyTuple_GET_ITEM(key, 0))
        else:
            hashed = PyObject_Hash(<object>PyTuple_GET_ITEM(key, index))
        lane = <uint64_t>hashed
        accumulated += lane * XXPRIME_2
        accumulated = (accumulated << 31) | (accumulated >> 33)
        accumulated *= XXPRIME_1
    accumulated += <uint64_t>size ^ (XXPRIME_5 ^ 3527539ULL)
    if accumulated == <uint64_t>-1:
        return 1546275796
    return <Py_hash_t>accumulated


def hash_of(key):
    """The hash the map works a key out by (``hash(key)``; for the tests)."""
    return key_hash(key)


def same_text(str one not None, str other not None):
    """Whether the map finds two exact texts equal (for the tests)."""
    return _same_text(<PyObject *>one, <PyObject *>other)


cdef inline uint64_t mixed(Py_hash_t hash) noexcept:
    """The key's hash spread over 64 bits (Fibonacci hashing): its top bits
    place it in the index, and are kept beside its record's number."""
    return <uint64_t>hash * <uint64_t>0x9E3779B97F4A7C15ULL


cdef inline uint64_t hashed_key(object key) except? 0:
    """The key's hash as the map places it: ``key_hash``, mixed."""
    return mixed(key_hash(key))


@cython.final
cdef class StateMap:
    """``sidecar.bounded.StateMap`` in C; see the module's docstring."""

    def __cinit__(self, Py_ssize_t max_keys, clock):
        self.max_keys = max_keys
        self.expect_from = EXPECTED_FROM
        self._clock = clock
        self._records = NULL
        self._block = NULL
        self._index = NULL
        self._allocated = self._count = self._untouched = self._spares = 0
        self._spare = NULL
        self._ring = NULL
        self._ring_size = self._tail = self._head = 0
        self._bits = 0
        self._wheel = {}
        self._slots = []
        self._recent = [None] * RECENT_SLOTS
        self._missed = NOTHING
        self._expected_count = self._expected_next = 0
        self._grow(FIRST_RECORDS)

    def __dealloc__(self):
        cdef int32_t index
        self._forget_expected()
        if self._records != NULL:
            for index in range(self._untouched):
                if self._records[index].parts[0] != NULL:
                    self._release(self._records[index])
            PyMem_RawFree(self._block)
        PyMem_RawFree(self._index)
        PyMem_RawFree(self._spare)
        PyMem_RawFree(self._ring)

    # -- the index ------------------------------------------------------------

    cdef int _grow(self, Py_ssize_t wanted) except -1:
        """Room for ``wanted`` records, and an index and a recency ring of at
        least twice as many entries, the index rebuilt from the live records."""
        cdef Record *records
        cdef void *block
        cdef uint64_t *index
        cdef uint64_t *ring
        cdef int32_t *spare
        cdef int bits = 4
        cdef int32_t number
        if wanted > 0x3FFFFFFF:
            raise MemoryError("a state map holds at most 2 ** 30 keys")
        while (<Py_ssize_t>1 << bits) < 2 * wanted:
            bits += 1
        # A record is a line of memory, and starts one (the allocator's
        # blocks are aligned to 16 bytes only): a record read is one line
        # missed, not two. Every array is asked for before any is
        # replaced: refused, the map stays as it was.
        block = PyMem_RawMalloc(wanted * sizeof(Record) + LINE - 1)
        spare = <int32_t *>PyMem_RawMalloc(wanted * sizeof(int32_t))
        ring = <uint64_t *>PyMem_RawMalloc(2 * wanted * sizeof(uint64_t))
        index = <uint64_t *>PyMem_RawMalloc((<size_t>1 << bits) * sizeof(uint64_t))
        if block == NULL or spare == NULL or ring == NULL or index == NULL:
            PyMem_RawFree(block)
            PyMem_RawFree(spare)
            PyMem_RawFree(ring)
            PyMem_RawFree(index)
            raise MemoryError()
        records = <Record *>((<uintptr_t>block + LINE - 1) & ~(<uintptr_t>LINE - 1))
        if self._records != NULL:
            memcpy(records, self._records, self._allocated * sizeof(Record))
        PyMem_RawFree(self._block)
        self._block = block
        self._records = records
        memset(&records[self._allocated], 0, (wanted - self._allocated) * sizeof(Record))
        self._allocated = <int32_t>wanted
        if self._spare != NULL:
            memcpy(spare, self._spare, self._spares * sizeof(int32_t))
        PyMem_RawFree(self._spare)
        self._spare = spare
        if self._ring != NULL:
            memcpy(ring, &self._ring[self._tail], (self._head - self._tail) * sizeof(uint64_t))
        PyMem_RawFree(self._ring)
        self._ring = ring
        self._head -= self._tail
        self._tail = 0
        self._ring_size = 2 * wanted
        memset(index, 0, (<size_t>1 << bits) * sizeof(uint64_t))
        PyMem_RawFree(self._index)
        self._index = index
        self._bits = bits
        for number in range(self._untouched):
            if records[number].parts[0] != NULL:
                self._place(<uint64_t>records[number].tag << 32, number)
        return 0

    cdef inline size_t _home(self, uint64_t hashed) noexcept:
        return <size_t>(hashed >> (64 - self._bits))

    cdef inline void _place(self, uint64_t hashed, int32_t number) noexcept:
        cdef size_t mask = (<size_t>1 << self._bits) - 1
        cdef size_t at = self._home(hashed)
        while self._index[at] != 0:
            at = (at + 1) & mask
        self._index[at] = (hashed & TAG_BITS) | <uint64_t>(number + 1)
        self._records[number].tag = <uint32_t>(hashed >> 32)

    cdef inline size_t _entry_of(self, int32_t number) noexcept:
        """The index entry of a live record, found from its tag: no hash of
        its key, no read of it."""
        cdef size_t mask = (<size_t>1 << self._bits) - 1
        cdef uint64_t entry = (<uint64_t>self._records[number].tag << 32) | <uint64_t>(number + 1)
        cdef size_t at = self._home(entry)
        while self._index[at] != entry:
            at = (at + 1) & mask
        return at

    cdef Py_ssize_t _find(self, key, uint64_t hashed) except -2:
        """The index entry of ``key``'s record, or -1 (then ``key`` is not held)."""
        cdef size_t mask = (<size_t>1 << self._bits) - 1
        cdef size_t at = self._home(hashed)
        cdef uint64_t entry, tag = hashed & TAG_BITS
        cdef Record *record
        while True:
            entry = self._index[at]
            if entry == 0:
                return -1
            if (entry & TAG_BITS) == tag:
                record = &self._records[<int32_t>(entry & NUMBER_BITS) - 1]
                if record.items == 0:
                    if record.parts[0] == <PyObject *>key or \
                            PyObject_RichCompareBool(<object>record.parts[0], key, Py_EQ):
                        return <Py_ssize_t>at
                elif self._holds_items(record, key):
                    return <Py_ssize_t>at
            at = (at + 1) & mask

    cdef int _holds_items(self, Record *record, key) except -1:
        """Whether the tuple kept as its items equals ``key``, compared as
        the tuple would have been: item by item, the stored one first."""
        cdef PyObject *item
        cdef Py_ssize_t index
        if not PyTuple_Check(key):
            return PyObject_RichCompareBool(self._key(record), key, Py_EQ)
        if PyTuple_GET_SIZE(key) != record.items:
            return False
        for index in range(record.items):
            item = PyTuple_GET_ITEM(key, index)
            if item == record.parts[index]:
                continue
            # Two texts (a request's value, equal to a stored key's and
            # another object: a path, a header, a client's key made again)
            # compared as CPython compares them, without its calls.
            if PyUnicode_CheckExact(<object>item) and PyUnicode_CheckExact(<object>record.parts[index]):
                if not _same_text(record.parts[index], item):
                    return False
            elif not PyObject_RichCompareBool(<object>record.parts[index], <object>item, Py_EQ):
                return False
        return True

    cdef object _key(self, Record *record):
        """A live record's key: the tuple made again from its items, or the
        key itself."""
        cdef Py_ssize_t index
        cdef object key
        if record.items == 0:
            return <object>record.parts[0]
        key = PyTuple_New(record.items)
        for index in range(record.items):
            Py_INCREF(<object>record.parts[index])
            PyTuple_SET_ITEM(key, index, <object>record.parts[index])
        return key

    cdef void _keep_key(self, Record *record, key) noexcept:
        """Hold ``key`` in a new record: a short exact tuple as its items."""
        cdef Py_ssize_t index
        if PyTuple_CheckExact(key) and 2 <= PyTuple_GET_SIZE(key) <= MOST_ITEMS:
            record.items = <uint8_t>PyTuple_GET_SIZE(key)
            for index in range(record.items):
                record.parts[index] = PyTuple_GET_ITEM(key, index)
                Py_INCREF(<object>record.parts[index])
        else:
            record.items = 0
            record.parts[0] = <PyObject *>key
            Py_INCREF(key)

    cdef inline void _release(self, Record record) noexcept:
        """Let go of what a record held: a copy, taken once the map no
        longer has it (a key's or state's deallocation may run any code)."""
        cdef Py_ssize_t index
        for index in range(max(record.items, 1)):
            Py_DECREF(<object>record.parts[index])
        Py_DECREF(<object>record.value)

    cdef inline void _unplace(self, size_t at) noexcept:
        """Empty an index entry, shifting back the later entries of its probe
        that may no longer be found past the gap (linear probing's deletion)."""
        cdef size_t mask = (<size_t>1 << self._bits) - 1
        cdef size_t gap = at, home
        cdef uint64_t entry
        while True:
            at = (at + 1) & mask
            entry = self._index[at]
            if entry == 0:
                break
            home = self._home(entry)
            # Keep the entry where it is when its home lies cyclically in
            # (gap, at]: nearer to it, going back, than the gap is.
            if ((at - home) & mask) < ((at - gap) & mask):
                continue
            self._index[gap] = entry
            gap = at
        self._index[gap] = 0

    # -- the lists ------------------------------------------------------------

    cdef inline void _link_newest(self, int32_t number) noexcept:
        """Make a live record the newest: a new entry at the ring's head, its
        earlier one (if any) stale."""
        cdef Record *record = &self._records[number]
        record.stamp += 1
        if self._head == self._ring_size:
            self._compact()
        self._ring[self._head] = (<uint64_t>record.stamp << 32) | <uint32_t>number
        self._head += 1

    cdef void _compact(self) noexcept:
        """Room at the ring's head: its entries moved to its start, without
        the stale ones when they would fill more than three quarters of it.
        A ring twice the records holds at most half its size of current
        entries (one a live record), so each compaction leaves a quarter of
        it free at least: its cost spread over as many entries made."""
        cdef Py_ssize_t at, kept = 0
        cdef uint64_t entry
        if self._head - self._tail <= self._ring_size * 3 // 4:
            memmove(self._ring, &self._ring[self._tail], (self._head - self._tail) * sizeof(uint64_t))
            self._head -= self._tail
        else:
            for at in range(self._tail, self._head):
                if at + FETCHED_AHEAD < self._head:
                    prefetch(&self._records[<int32_t>(self._ring[at + FETCHED_AHEAD] & NUMBER_BITS)])
                entry = self._ring[at]
                if self._records[<int32_t>(entry & NUMBER_BITS)].stamp == <uint32_t>(entry >> 32):
                    self._ring[kept] = entry
                    kept += 1
            self._head = kept
        self._tail = 0

    cdef inline int _file(self, int32_t number, double expires) except -1:
        """File the record under the wheel slot of ``expires``, last."""
        cdef long long slot = wheel_slot(expires)
        cdef _Slot filed = <_Slot>self._recent[slot & (RECENT_SLOTS - 1)]
        cdef Record *record = &self._records[number]
        if filed is None or filed.number != slot:
            filed = self._wheel.get(slot)
            if filed is None:
                filed = _Slot.__new__(_Slot)
                filed.number = slot
                filed.first = filed.last = NONE
                self._wheel[slot] = filed
                heapq.heappush(self._slots, slot)
                if len(self._slots) > 2 * len(self._wheel) + 64:
                    # Slots emptied and made again: drop the heap's duplicates.
                    self._slots = list(self._wheel)
                    heapq.heapify(self._slots)
            self._recent[slot & (RECENT_SLOTS - 1)] = filed
        record.slot = slot
        record.wheel_next = NONE
        record.wheel_prev = filed.last
        if filed.last != NONE:
            self._records[filed.last].wheel_next = number
        else:
            filed.first = number
        filed.last = number
        return 0

    cdef inline int _unfile(self, int32_t number) except -1:
        cdef Record *record = &self._records[number]
        cdef _Slot filed = <_Slot>self._recent[record.slot & (RECENT_SLOTS - 1)]
        if filed is None or filed.number != record.slot:
            filed = self._wheel[record.slot]
        if record.wheel_prev != NONE:
            self._records[record.wheel_prev].wheel_next = record.wheel_next
        else:
            filed.first = record.wheel_next
        if record.wheel_next != NONE:
            self._records[record.wheel_next].wheel_prev = record.wheel_prev
        else:
            filed.last = record.wheel_prev
        if filed.first == NONE:
            del self._wheel[record.slot]
            if self._recent[record.slot & (RECENT_SLOTS - 1)] is filed:
                self._recent[record.slot & (RECENT_SLOTS - 1)] = None
        return 0

    # -- records --------------------------------------------------------------

    cdef inline int _drop(self, int32_t number, size_t at) except -1:
        """Drop the record ``number`` (index entry ``at``), keeping its key
        and value alive until the map is consistent again."""
        cdef Record record = self._records[number]
        self._unplace(at)
        self._records[number].stamp += 1  # its ring entry stale
        self._unfile(number)
        self._records[number].parts[0] = self._records[number].value = NULL
        self._spare[self._spares] = number
        self._spares += 1
        self._count -= 1
        self._release(record)
        return 0

    cdef inline int _drop_key(self, int32_t number) except -1:
        """Drop a record found by its number (making room)."""
        return self._drop(number, self._entry_of(number))

    cdef inline int32_t _new_record(self) except -1:
        cdef int32_t number
        if self._spares > 0:
            self._spares -= 1
            number = self._spare[self._spares]
            if self._spares >= SPARES_AHEAD:
                # A coming new key's record, freed when room was last made
                # and out of the nearest caches by now: asked for ahead.
                prefetch(&self._records[self._spare[self._spares - SPARES_AHEAD]])
            return number
        if self._untouched == self._allocated:
            # Doubling, but no further than the cap: the map never holds more.
            self._grow(max(min(2 * <Py_ssize_t>self._allocated, self.max_keys), self._allocated + 1))
        number = self._untouched
        self._untouched += 1
        return number

    cdef inline int32_t _number(self, Py_ssize_t at) noexcept:
        """The record of the index entry ``at``."""
        return <int32_t>(self._index[at] & NUMBER_BITS) - 1

    cdef int _replace(self, int32_t number, value, double expires) except -1:
        """A held key's new state: in its place, unread (a new state, as the
        pure map's), filed again only under an earlier slot."""
        cdef object stored = <object>self._records[number].value
        Py_INCREF(value)
        self._records[number].value = <PyObject *>value
        self._records[number].used = False
        Py_DECREF(stored)
        if wheel_slot(expires) < self._records[number].slot:
            self._unfile(number)
            self._file(number, expires)
        return 0

    # -- the map --------------------------------------------------------------

    cpdef hint(self, key, Py_ssize_t position):
        """Ask for the memory of the index entry of a key read soon, the
        ``position``-th of its request's (0 forgets the last request's):
        the matching program hints each check's key as it makes it, so that
        the entry is on its way while the next rules are matched, and
        ``expect`` finds the keys hashed and their entries asked for.
        Nothing changes; ignored while the map holds fewer than
        ``expect_from`` keys, and past ``MOST_EXPECTED`` keys."""
        cdef int index = <int>position
        if position == 0:
            self._forget_expected()
        if self._count < self.expect_from or position != self._expected_count or position >= MOST_EXPECTED:
            return
        self._keep_expected(index, key)

    cdef int _keep_expected(self, int index, key) except -1:
        """Keep ``key`` as the ``index``-th expected (the next), its hash
        with it, and ask for its index entry."""
        self._expected_hash[index] = hashed_key(key)
        Py_INCREF(key)
        self._expected[index] = <PyObject *>key
        self._expected_count = index + 1
        prefetch(&self._index[self._home(self._expected_hash[index])])
        return 0

    cdef int _hinted(self, checks, Py_ssize_t count) except -1:
        """Whether the keys hinted are the first ``count`` checks' (the same
        objects, in order), none read yet."""
        cdef Py_ssize_t index
        if self._expected_count != count or self._expected_next != 0:
            return False
        for index in range(count):
            if self._expected[index] != <PyObject *>(<Check?>checks[index]).key:
                return False
        return True

    cpdef expect(self, checks):
        """Ask for the memory of the checks' keys ahead of their reads: the
        index entries of them all (unless ``hint`` asked for them as the
        checks were made), then the records those entries name, then the
        states and items those records hold, each step for every key before
        the next. A decision reads its keys one after the other, each read
        waiting for its lines of memory; asked for together, the misses of
        many clients' keys (lines out of the CPU's cache) overlap instead of
        following one another. The keys' hashes are kept for their reads.
        Nothing changes: a hint, which the pure map ignores, and this one
        too while it holds fewer than ``expect_from`` keys. At most
        ``MOST_EXPECTED`` keys; ``checks`` is a list of
        ``sidecar.state.Check``."""
        cdef size_t homes[MOST_EXPECTED]
        cdef int32_t numbers[MOST_EXPECTED]
        cdef Py_ssize_t count
        cdef Py_ssize_t index, part
        cdef size_t at, mask = (<size_t>1 << self._bits) - 1
        cdef uint64_t entry, tag
        cdef Record *record
        if self._count < self.expect_from:
            self._forget_expected()
            return
        count = min(len(checks), <Py_ssize_t>MOST_EXPECTED)
        if not self._hinted(checks, count):
            self._forget_expected()
            for index in range(count):
                self._keep_expected(<int>index, (<Check?>checks[index]).key)
        for index in range(count):
            homes[index] = self._home(self._expected_hash[index])
        for index in range(count):
            numbers[index] = NONE
            at = homes[index]
            tag = self._expected_hash[index] & TAG_BITS
            while True:
                entry = self._index[at]
                if entry == 0:
                    break  # a new key: its read finds this entry empty
                if (entry & TAG_BITS) == tag:
                    numbers[index] = <int32_t>(entry & NUMBER_BITS) - 1
                    prefetch(&self._records[numbers[index]])
                    break
                at = (at + 1) & mask
        for index in range(count):
            if numbers[index] == NONE:
                continue
            record = &self._records[numbers[index]]
            prefetch(record.value)
            # A tuple key's first item is a rule's prefix: in the cache.
            for part in range(1, record.items):
                prefetch_text(record.parts[part])

    cdef void _forget_expected(self) noexcept:
        cdef int index
        cdef int count = self._expected_count
        self._expected_count = self._expected_next = 0
        for index in range(count):
            Py_DECREF(<object>self._expected[index])

    cdef uint64_t _hash_of(self, key) except? 0:
        """The key's mixed hash: the one ``expect`` kept when the key is the
        next it hashed, else worked out."""
        cdef int next = self._expected_next
        if next < self._expected_count and <PyObject *>key == self._expected[next]:
            self._expected_next = next + 1
            return self._expected_hash[next]
        return hashed_key(key)

    cpdef get(self, key):
        cdef uint64_t hashed = self._hash_of(key)
        cdef Py_ssize_t at = self._find(key, hashed)
        cdef Record *record
        if at < 0:
            self._missed = key
            self._missed_hash = hashed
            return None
        record = &self._records[self._number(at)]
        record.used = True
        return <object>record.value

    def peek(self, key):
        """The key's state, or None; not a use (an administrator's look)."""
        cdef Py_ssize_t at = self._find(key, hashed_key(key))
        if at < 0:
            return None
        return <object>self._records[self._number(at)].value

    cpdef add(self, key, value, expires=None):
        """Store a key, most often one not in the map (see the pure map's
        ``add``); a key held already keeps its place, its new state filed
        under an earlier slot only."""
        self.store(key, value, state_expiry(value) if expires is None else <double>expires)

    cdef int store(self, key, value, double when) except -1:
        """``add`` of a state whose expiry the caller knows (the policy
        asks its limiter, in C)."""
        cdef bint missed = key is self._missed
        cdef uint64_t hashed = self._missed_hash if missed else hashed_key(key)
        cdef int32_t number
        cdef Py_ssize_t at
        cdef Record *record
        self._missed = NOTHING
        if self._count >= self.max_keys:
            self._make_room()
            # Dropping a key runs its state's deallocation, which may store.
            missed = False
        # Not found by the last read, and nothing stored since: still not held.
        at = -1 if missed else self._find(key, hashed)
        if at >= 0:
            return self._replace(self._number(at), value, when)
        number = self._new_record()
        record = &self._records[number]
        self._keep_key(record, key)
        Py_INCREF(value)
        record.value = <PyObject *>value
        self._records[number].used = False
        self._count += 1
        self._place(hashed, number)
        self._link_newest(number)
        return self._file(number, when)

    def __setitem__(self, key, value):
        cdef Py_ssize_t at = self._find(key, hashed_key(key))
        cdef int32_t number
        if at < 0:
            self.add(key, value)
            return
        number = self._number(at)
        if <PyObject *>value != self._records[number].value:
            self._replace(number, value, state_expiry(value))

    def pop(self, key, default=None):
        cdef Py_ssize_t at = self._find(key, hashed_key(key))
        cdef int32_t number
        cdef object value
        if at < 0:
            return default
        number = self._number(at)
        value = <object>self._records[number].value
        self._drop(number, <size_t>at)
        return value

    def marked(self, key):
        """Whether the key was read since it was stored or last passed over
        when room was made (False when not held)."""
        cdef Py_ssize_t at = self._find(key, hashed_key(key))
        return at >= 0 and self._records[self._number(at)].used != 0

    def __len__(self):
        return self._count

    def __contains__(self, key):
        return self._find(key, hashed_key(key)) >= 0

    def items(self):
        """(key, state) of every key, oldest first."""
        cdef list found = []
        cdef Py_ssize_t at
        cdef uint64_t entry
        cdef Record *record
        for at in range(self._tail, self._head):
            entry = self._ring[at]
            record = &self._records[<int32_t>(entry & NUMBER_BITS)]
            if record.stamp == <uint32_t>(entry >> 32):
                found.append((self._key(record), <object>record.value))
        return found

    def values(self):
        return [value for _, value in self.items()]

    @property
    def data(self):
        """A copy of the map as a dict, oldest first (tests and listings)."""
        return dict(self.items())

    @property
    def _filed(self):
        """References in the wheel: one per key, never a stale one."""
        return self._count

    # -- making room ----------------------------------------------------------

    cdef int _make_room(self) except -1:
        """Drop the expired keys of the wheel's past slots, refiling the
        others, then the oldest unread ones (``_drop_oldest``).

        A slot's records are taken ``OPENED_AHEAD`` at a time, in the order
        filed, and the memory their expiry and drop read (each state, key
        and index entry) asked for before the first is looked at: the slot's
        list still names one record after the other, but the misses behind
        each record overlap. Each record is then looked at in turn, if still
        filed under the slot (a state's deallocation may run any code); then
        the slot's first record again, as every one looked at has left it."""
        cdef double now = self._clock()
        cdef long long current = wheel_slot(now)
        cdef _Slot filed
        cdef long long slot
        cdef int32_t taken[OPENED_AHEAD]
        cdef int count_taken, index, part
        cdef int32_t number
        cdef Record *record
        cdef double expires
        cdef Py_ssize_t target
        while self._slots and <long long>self._slots[0] < current:
            slot = heapq.heappop(self._slots)
            filed = self._wheel.get(slot)
            if filed is None:
                continue  # emptied since (its keys dropped or forgotten)
            while filed.first != NONE:
                count_taken = 0
                number = filed.first
                while number != NONE and count_taken < OPENED_AHEAD:
                    record = &self._records[number]
                    prefetch(record.value)
                    if record.items == 0:
                        prefetch_text(record.parts[0])
                    for part in range(1, record.items):
                        prefetch_text(record.parts[part])
                    prefetch(&self._index[self._home(<uint64_t>record.tag << 32)])
                    taken[count_taken] = number
                    count_taken += 1
                    number = record.wheel_next
                for index in range(count_taken):
                    number = taken[index]
                    if self._records[number].parts[0] == NULL or self._records[number].slot != slot:
                        continue  # dropped or moved since it was taken
                    expires = state_expiry(<object>self._records[number].value)
                    # Expired before this second, as the pure map decides.
                    if expires < <double>current:
                        self._drop_key(number)
                    else:
                        # Outlived its slot: filed again, under a slot not yet past.
                        self._unfile(number)
                        self._file(number, expires)
        target = max(0, min(self.max_keys - 1, self.max_keys - self.max_keys // 100))
        if self._count > target:
            self._drop_oldest(self._count - target)
        return 0

    cdef int _drop_oldest(self, Py_ssize_t count) except -1:
        """The oldest unread states go; a read one is moved to the newest
        end, unmarked (its second chance).

        They are the recency ring's entries from its tail, the stale ones
        passed over. Under rotation none of their memory is in the CPU's
        cache; the ring names the records ahead without reading any, so
        their memory is asked for ``FETCHED_AHEAD`` entries ahead, and the
        memory that dropping them reads (each key, state and index entry)
        ``OPENED_AHEAD`` entries ahead, and the objects those states hold
        ``DEEP_AHEAD`` ahead: the misses overlap instead of following one
        another."""
        cdef Py_ssize_t fetched = 0, opened = 0, deep = 0  # entries past the tail asked for
        cdef Py_ssize_t index
        cdef uint64_t entry
        cdef int32_t number
        cdef Record *record
        while count > 0 and self._tail < self._head:
            while fetched < FETCHED_AHEAD and self._tail + fetched < self._head:
                prefetch(&self._records[<int32_t>(self._ring[self._tail + fetched] & NUMBER_BITS)])
                fetched += 1
            while opened < OPENED_AHEAD and opened < fetched and self._tail + opened < self._head:
                record = &self._records[<int32_t>(self._ring[self._tail + opened] & NUMBER_BITS)]
                # A tuple key's first item is a rule's prefix, which every
                # key of the rule shares: its others are the ones to fetch.
                if record.items == 0:
                    prefetch_text(record.parts[0])
                for index in range(1, record.items):
                    prefetch_text(record.parts[index])
                prefetch(record.value)
                prefetch(&self._index[self._home(<uint64_t>record.tag << 32)])
                opened += 1
            while deep < DEEP_AHEAD and deep < opened and self._tail + deep < self._head:
                prefetch_fields(self._records[<int32_t>(self._ring[self._tail + deep] & NUMBER_BITS)].value)
                deep += 1
            entry = self._ring[self._tail]
            self._tail += 1
            fetched -= 1
            opened -= 1
            deep -= 1
            number = <int32_t>(entry & NUMBER_BITS)
            if self._records[number].stamp != <uint32_t>(entry >> 32):
                continue  # stale: made newest again since, or dropped
            if self._records[number].used:
                # May compact the ring: the counts ahead stay a hint only.
                self._records[number].used = False
                self._link_newest(number)
            else:
                self._drop_key(number)
                count -= 1
        return 0
