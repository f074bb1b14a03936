# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled zone: fixed-size records in memory that every worker of a
node maps, in stripes each locked by a robust process-shared mutex.

The layout and every algorithm are ``pure_zone``'s (read its docstring
first); this module is the same zone in C over a ``MAP_SHARED`` mapping, with
a real lock in each stripe's lock slot:

- a ``pthread_mutex_t`` made process-shared (it lives in the mapping),
  robust (when its owner dies, the next locker gets ``EOWNERDEAD`` instead
  of waiting forever) and error-checking (locking twice from one thread is
  an error, not a hang);
- ``EOWNERDEAD``: the dead owner may have been halfway through a write, so
  the stripe's undo copy is put back and the stripe rebuilt from its live records (``_rebuild_stripe``, as
  ``pure_zone.Zone._rebuild``), the mutex is marked consistent and the
  recovery is counted in the zone's header;
- a lock is first tried without waiting; a busy one is counted
  (``waits``) and tried again a few dozen times with a pause between (its
  owner holds it for a few microseconds: sleeping in the kernel and being
  woken costs more), and only then does the thread release the GIL and
  wait, so a worker's other threads run.

A record's state is stored between compiler barriers (``sz_set_state``): a
process killed at any instruction leaves either a live record whole or a
record marked as being written, which the rebuild drops.
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.errno cimport EBUSY, EPERM, errno
from libc.math cimport isnan
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset
from posix.mman cimport MAP_ANONYMOUS, MAP_FAILED, MAP_SHARED, PROT_READ, PROT_WRITE, mmap, munmap

import os

from sidecar.shm import pure_zone


cdef extern from *:
    # GCC's and Clang's: ask for a line of memory before it is read.
    void prefetch "__builtin_prefetch"(const void *address) noexcept nogil


cdef enum:
    NIL = 0
    FREE = 0
    LIVE = 1
    WRITING = 2
    DIGEST_SIZE = 16
    RECORD_HEADER = 40
    HEADER_SIZE = 256
    STRIPE_HEADER = 128
    EXPIRED_SCAN = 8
    SECRET_AT = 128
    SECRET_SIZE = 16
    MASK_STRIPES = 64  # stripes a mask of stripes names (lock_mask)
    SPINS = 64  # tries of a busy lock before sleeping on it (its owner holds it for a few microseconds)

assert (pure_zone.FREE, pure_zone.LIVE, pure_zone.WRITING, pure_zone.NIL) == (FREE, LIVE, WRITING, NIL)
assert (pure_zone.DIGEST_SIZE, pure_zone.RECORD_HEADER, pure_zone.HEADER_SIZE) == (DIGEST_SIZE, RECORD_HEADER, HEADER_SIZE)
assert (pure_zone.STRIPE_HEADER, pure_zone.EXPIRED_SCAN) == (STRIPE_HEADER, EXPIRED_SCAN)
assert (pure_zone.MASK_STRIPES, pure_zone.SECRET_AT, pure_zone.SECRET_SIZE) == (MASK_STRIPES, SECRET_AT, SECRET_SIZE)


cdef inline const unsigned char *_digest(object digest) except NULL:
    """The bytes of a 16-byte digest; the twin's ValueError otherwise."""
    if not PyBytes_Check(digest) or PyBytes_GET_SIZE(digest) != DIGEST_SIZE:
        pure_zone.check_digest(digest)
    return <const unsigned char *>PyBytes_AS_STRING(digest)


cdef inline int _check_time(str name, double when) except -1:
    if isnan(when):
        raise ValueError(f"{name} is a number of seconds, not NaN")
    return 0


@cython.final
cdef class Zone:
    """A zone that every process of a node maps: see the module's and
    ``pure_zone``'s docstrings. The API is the twin's."""

    # Its fields and C methods are declared in _zone.pxd (node.pxd cimports it).

    def __dealloc__(self):
        if self._base != NULL:
            munmap(self._base, self._mapped)

    # -- making, attaching, closing --------------------------------------

    @staticmethod
    def create(path, capacity, value_size, stripes):
        """A new zone file at ``path`` (which must not exist; mode 0600,
        /dev/shm/... in production), its memory reserved now, its mutexes
        made."""
        found = pure_zone.layout(capacity, value_size, stripes)
        path = os.fspath(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        cdef Zone zone = Zone.__new__(Zone)
        try:
            pure_zone.reserve(fd, found.file_size)
            zone._map(fd, found, path)
            zone._make(found)
        except BaseException:
            zone._unmap()
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return zone

    @staticmethod
    def attach(path):
        """The zone at ``path``, made by another process's ``create``: its
        header checked (magic, version, layout, the file's size)."""
        cdef Zone zone = Zone.__new__(Zone)
        path = os.fspath(path)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            found, locks = pure_zone.read_layout(os.pread(fd, HEADER_SIZE, 0), size, path)
            if locks != pure_zone.LOCKS_ROBUST:
                raise ValueError(f"{path} is a zone made by the pure-Python zone, which has no locks "
                                 "between processes: make it with the compiled zone")
            zone._map(fd, found, path)
        finally:
            os.close(fd)
        return zone

    @staticmethod
    def private(capacity, value_size, stripes):
        """A zone without a file, in memory of this process (shared with its
        children if it forks)."""
        found = pure_zone.layout(capacity, value_size, stripes)
        cdef Zone zone = Zone.__new__(Zone)
        zone._map(-1, found, None)
        zone._make(found)
        return zone

    cdef int _map(self, int fd, object found, object path) except -1:
        cdef size_t size = found.file_size
        cdef int flags = MAP_SHARED if fd >= 0 else MAP_SHARED | MAP_ANONYMOUS
        cdef void *memory = mmap(NULL, size, PROT_READ | PROT_WRITE, flags, fd, 0)
        cdef int error = errno
        if memory == MAP_FAILED:
            raise OSError(error, f"mapping a zone of {size} bytes: {os.strerror(error)}")
        self._base = <unsigned char *>memory
        self._mapped = size
        self._header = <sz_header *>memory
        self.path = path
        self.capacity = found.capacity
        self.value_size = found.value_size
        self.stripes = found.stripes
        self.per_stripe = found.per_stripe
        self.record_size = found.record_size
        self.file_size = found.file_size
        self._stripe_size = found.stripe_size
        self._buckets_at = found.buckets_at
        self._records_at = found.records_at
        self._bucket_mask = found.bucket_count - 1
        return 0

    cdef int _make(self, object found) except -1:
        """A new zone's header and mutexes; ready last, for attach to see."""
        header = bytearray(pure_zone.LAYOUT.size)
        pure_zone.write_layout(header, found, pure_zone.LOCKS_ROBUST)
        memcpy(self._base, <const char *>header, len(header))
        secret = os.urandom(SECRET_SIZE)
        memcpy(self._base + SECRET_AT, <const char *>secret, SECRET_SIZE)
        cdef Py_ssize_t stripe
        cdef int rc
        for stripe in range(self.stripes):
            rc = sz_mutex_init(&self._stripe(stripe).lock.mutex)
            if rc != 0:
                raise OSError(rc, f"making a zone's lock: {os.strerror(rc)}")
        sz_store32(&self._header.ready, 1)
        return 0

    cdef void _unmap(self) noexcept:
        if self._base != NULL:
            munmap(self._base, self._mapped)
            self._base = NULL
            self._header = NULL

    def close(self):
        """Unmap the zone; every later operation raises ValueError. Closing
        while this object holds or waits for a lock is a mistake (RuntimeError)."""
        if self._held:
            raise RuntimeError(f"closing a zone with stripes still locked ({self._held} held or awaited)")
        self._unmap()

    def unlink(self):
        """Remove the zone's file (the processes attached keep their mapping)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    cdef int _check_open(self) except -1:
        if self._base == NULL:
            raise ValueError("the zone is closed")
        return 0

    # -- stripes and locks -----------------------------------------------

    cdef sz_stripe *_stripe(self, Py_ssize_t stripe) noexcept:
        return <sz_stripe *>(self._base + HEADER_SIZE + stripe * self._stripe_size)

    cdef Py_ssize_t _stripe_index(self, const unsigned char *digest) noexcept:
        cdef uint64_t high
        memcpy(&high, digest, 8)
        return <Py_ssize_t>(high % <uint64_t>self.stripes)

    cdef sz_stripe *_locked_stripe(self, Py_ssize_t stripe) except NULL:
        cdef sz_stripe *found = self._stripe(stripe)
        if not sz_mutex_held(&found.lock.mutex):
            raise RuntimeError(f"stripe {stripe} is not locked: lock it before using it")
        return found

    cpdef Py_ssize_t stripe_of(self, digest) except -1:
        """The stripe of a 16-byte digest (its first 8 bytes; the last 8 pick
        its hash bucket)."""
        return self._stripe_index(_digest(digest))

    def stripes_for(self, digests):
        """The stripes of these digests, sorted and once each: what to lock."""
        return sorted({self._stripe_index(_digest(digest)) for digest in digests})

    cdef int _check_stripes(self, object stripes) except -1:
        cdef Py_ssize_t previous = -1
        for stripe in stripes:
            if type(stripe) is not int or not previous < stripe < self.stripes:
                pure_zone.check_stripes(stripes, self.stripes)
                raise ValueError(f"stripes are locked in increasing order, each once: {list(stripes)}")
            previous = stripe
        return 0

    cpdef lock(self, stripes):
        """Lock these stripes (increasing order, each once: deadlock-free),
        waiting without the GIL. A lock whose owner died is taken over: the
        stripe rebuilt, the recovery counted. Locking a stripe this thread
        holds is a RuntimeError."""
        self._check_open()
        self._check_stripes(stripes)
        taken = []
        try:
            for stripe in stripes:
                self._acquire(stripe)
                taken.append(stripe)
        except BaseException:
            for stripe in reversed(taken):
                self._release(stripe)
            raise

    cpdef unlock(self, stripes):
        """Unlock these stripes (as given to ``lock``); unlocking one this
        thread does not hold is a RuntimeError, after the others are unlocked."""
        self._check_open()
        self._check_stripes(stripes)
        error = None
        for stripe in reversed(stripes):
            error = self._release_noting(stripe, error)
        if error is not None:
            raise error

    cpdef lock_mask(self, unsigned long long mask):
        """``lock`` of the stripes whose bits are set in ``mask`` (stripe n:
        bit n; a zone of at most 64 stripes), in increasing order."""
        self._check_open()
        self._check_mask(mask)
        cdef Py_ssize_t stripe
        cdef unsigned long long taken = 0
        try:
            for stripe in range(self.stripes):
                if mask >> stripe & 1:
                    self._acquire(stripe)
                    taken |= (<unsigned long long>1) << stripe
        except BaseException:
            self._release_mask(taken)
            raise

    cpdef unlock_mask(self, unsigned long long mask):
        """``unlock`` of the stripes whose bits are set in ``mask``."""
        self._check_open()
        self._check_mask(mask)
        self._release_mask(mask)

    cdef int _release_mask(self, unsigned long long mask) except -1:
        """Release the stripes of ``mask``, the highest first; one this
        thread does not hold is a RuntimeError, after the others."""
        cdef Py_ssize_t stripe
        error = None
        for stripe in range(self.stripes - 1, -1, -1):
            if mask >> stripe & 1:
                error = self._release_noting(stripe, error)
        if error is not None:
            raise error
        return 0

    cdef object _release_noting(self, Py_ssize_t stripe, object error):
        """Release ``stripe``: the RuntimeError of one not held, else ``error``."""
        try:
            self._release(stripe)
        except RuntimeError as problem:
            return problem
        return error

    cdef int _check_mask(self, unsigned long long mask) except -1:
        if self.stripes > MASK_STRIPES or (self.stripes < MASK_STRIPES and mask >> self.stripes):
            pure_zone.check_mask(mask, self.stripes)
            raise ValueError(f"a mask of stripes names stripes 0 to {self.stripes - 1}: {mask:#x}")
        return 0

    def locked(self, stripes):
        """Hold these stripes' locks for a ``with`` block."""
        return _Held(self, stripes)

    cdef int _acquire(self, Py_ssize_t stripe) except -1:
        cdef pthread_mutex_t *mutex = &self._stripe(stripe).lock.mutex
        self._held += 1
        cdef int rc = pthread_mutex_trylock(mutex)
        cdef int spin
        if rc == EBUSY:
            sz_increment(&self._header.waits)
            for spin in range(SPINS):
                sz_pause()
                rc = pthread_mutex_trylock(mutex)
                if rc != EBUSY:
                    break
            if rc == EBUSY:
                with nogil:
                    rc = pthread_mutex_lock(mutex)
        if rc == EOWNERDEAD:
            self._rebuild_stripe(self._stripe(stripe))
            rc = pthread_mutex_consistent(mutex)
            if rc == 0:
                sz_increment(&self._header.recoveries)
        if rc == 0:
            return 0
        self._held -= 1
        if rc == EDEADLK:
            raise RuntimeError(f"stripe {stripe} is already locked by this thread")
        raise OSError(rc, f"locking stripe {stripe} of the zone: {os.strerror(rc)}")

    cdef int _release(self, Py_ssize_t stripe) except -1:
        cdef int rc = pthread_mutex_unlock(&self._stripe(stripe).lock.mutex)
        if rc == EPERM:
            raise RuntimeError(f"stripe {stripe} is not locked by this thread")
        if rc != 0:
            raise OSError(rc, f"unlocking stripe {stripe} of the zone: {os.strerror(rc)}")
        self._held -= 1
        return 0

    # -- records -----------------------------------------------------------

    cpdef get(self, digest, double now):
        """The value stored under ``digest``, None when absent or expired at
        ``now``; a value found becomes the stripe's most recently used."""
        return self._read(digest, now, True)

    cpdef peek(self, digest, double now):
        """As ``get``, without changing the LRU order (an administrator's read)."""
        return self._read(digest, now, False)

    cdef object _read(self, object digest, double now, bint refresh):
        self._check_open()
        cdef const unsigned char *key = _digest(digest)
        _check_time("now", now)
        cdef sz_stripe *stripe = self._locked_stripe(self._stripe_index(key))
        cdef uint32_t found = self._find(stripe, key)
        if found == NIL:
            return None
        cdef sz_record *record = self._record(stripe, found)
        if record.expires <= now:
            return None
        if refresh:
            self._to_front(stripe, found)
        return PyBytes_FromStringAndSize(<char *>record + RECORD_HEADER, self._length(record))

    cpdef put(self, digest, value, double expires, double now):
        """Store ``value`` under ``digest`` until ``expires``, as the stripe's
        most recently used. A new digest in a full stripe takes an expired
        record among the least recently used, else the least recently used."""
        self._check_open()
        cdef const unsigned char *key = _digest(digest)
        if not PyBytes_Check(value) or PyBytes_GET_SIZE(value) > self.value_size:
            value = pure_zone.check_value(value, self.value_size)
        _check_time("expires", expires)
        _check_time("now", now)
        cdef sz_stripe *stripe = self._locked_stripe(self._stripe_index(key))
        cdef uint32_t found = self._find(stripe, key)
        if found != NIL:
            self._replace(stripe, found, key, value, expires)
            self._to_front(stripe, found)
            return
        found = self._take(stripe, now)
        cdef sz_record *record = self._record(stripe, found)
        self._write(record, key, value, expires)
        # Last in its bucket's chain (whose records the look above just
        # read): a chain holds its records oldest first, so the least
        # recently used, which a full stripe evicts, is found at once.
        record.chain = NIL
        cdef uint32_t *link = self._bucket(stripe, key)
        while link[0] != NIL:
            link = &self._record(stripe, link[0]).chain
        link[0] = found
        self._link_front(stripe, found)
        stripe.used += 1

    cpdef delete(self, digest):
        """Remove ``digest``'s record, expired or not; whether there was one."""
        self._check_open()
        cdef const unsigned char *key = _digest(digest)
        cdef sz_stripe *stripe = self._locked_stripe(self._stripe_index(key))
        cdef uint32_t found = self._find(stripe, key)
        if found == NIL:
            return False
        sz_set_state(self._record(stripe, found), FREE)  # freed first: a delete cut short is done
        self._remove(stripe, found)
        self._push_free(stripe, found)
        return True

    def scan(self, stripe, double now):
        """The stripe's records unexpired at ``now``: (digest, value, expires),
        most recently used first."""
        self._check_open()
        if type(stripe) is not int or not 0 <= stripe < self.stripes:
            pure_zone.check_stripes([stripe], self.stripes)
        _check_time("now", now)
        cdef sz_stripe *found = self._locked_stripe(stripe)
        cdef sz_record *record
        cdef uint32_t at = found.newest
        live = []
        while at != NIL:
            record = self._record(found, at)
            if record.expires > now:
                live.append((PyBytes_FromStringAndSize(<char *>record.digest, DIGEST_SIZE),
                             PyBytes_FromStringAndSize(<char *>record + RECORD_HEADER, self._length(record)),
                             record.expires))
            at = record.older
        return live

    def __len__(self):
        """Records in use, expired ones not yet taken back included; read
        without locks, so only a moment's count while others write."""
        self._check_open()
        cdef Py_ssize_t stripe, total = 0
        for stripe in range(self.stripes):
            total += sz_load32(&self._stripe(stripe).used)
        return total

    # -- counters -----------------------------------------------------------

    @property
    def secret(self):
        """The 16 random bytes drawn when the zone was made, the same for
        every process attached to it."""
        self._check_open()
        return PyBytes_FromStringAndSize(<char *>self._base + SECRET_AT, SECRET_SIZE)

    @property
    def recoveries(self):
        """Locks taken over from a dead owner, zone-wide."""
        self._check_open()
        return sz_load64(&self._header.recoveries)

    @property
    def evictions(self):
        """Unexpired records evicted to make room, zone-wide."""
        self._check_open()
        return sz_load64(&self._header.evictions)

    @property
    def waits(self):
        """Locks that were busy when asked for, zone-wide: how often workers
        meet on a stripe (each such lock was waited for without the GIL)."""
        self._check_open()
        return sz_load64(&self._header.waits)

    cpdef generation(self):
        """A number the store bumps when something every worker must reload changed."""
        self._check_open()
        return sz_load64(&self._header.generation)

    def bump_generation(self):
        """Add one to the generation, atomically; the new generation."""
        self._check_open()
        return sz_increment(&self._header.generation)

    # -- hints: memory asked for before a transaction needs it ------------------

    cpdef ask(self, digest):
        """A hint that ``digest``'s record is read or written soon: the
        memory of its bucket and of its stripe's fields is asked for, with
        no lock taken (``ask_records`` reads them next). Under a rotation of
        keys that memory is long out of the CPU's caches; a transaction that
        asks for all of its keys' at once waits for them together instead
        of one after the other. Nothing of the zone is read; a digest that
        is not one (or a closed zone) is ignored."""
        cdef const unsigned char *key = self._hinted(digest)
        if key == NULL:
            return
        cdef sz_stripe *stripe = self._stripe(self._stripe_index(key))
        prefetch(self._bucket(stripe, key))
        prefetch(&stripe.newest)

    cpdef ask_records(self, digest):
        """The hint after ``ask``: the records that reading or storing
        ``digest`` touches first are asked for, the first of its bucket's
        chain and, when the stripe is full, its least recently used (the
        one a new key takes). Their links are read without the lock: one
        torn or stale asks for other memory of the zone, never memory
        outside it, and changes nothing."""
        cdef const unsigned char *key = self._hinted(digest)
        if key == NULL:
            return
        cdef sz_stripe *stripe = self._stripe(self._stripe_index(key))
        self._ask_record(stripe, sz_load32(self._bucket(stripe, key)))
        if self._full(stripe):
            self._ask_record(stripe, sz_load32(&stripe.oldest))

    cpdef ask_victim(self, digest):
        """The hint before a new ``digest`` is stored in a full stripe: the
        memory that evicting the stripe's least recently used record touches
        (its bucket, its newer neighbour) is asked for, that record's
        memory having been asked for by ``ask_records``; and the records
        that follow it in the stripe, which the look for an expired one
        among the least recently used reads (under rotation the stripe's
        records are used again in their order, and the list of recency
        follows it). Read without the lock, as there."""
        cdef const unsigned char *key = self._hinted(digest)
        if key == NULL:
            return
        cdef sz_stripe *stripe = self._stripe(self._stripe_index(key))
        if not self._full(stripe):
            return
        cdef uint32_t oldest = sz_load32(&stripe.oldest)
        if oldest == NIL or oldest > <uint32_t>self.per_stripe:
            return
        cdef sz_record *record = self._record(stripe, oldest)
        prefetch(self._bucket(stripe, record.digest))
        self._ask_record(stripe, sz_load32(&record.newer))
        cdef uint32_t at
        for at in range(oldest + 1, min(oldest + EXPIRED_SCAN, <uint32_t>self.per_stripe + 1)):
            prefetch(self._record(stripe, at))

    cdef const unsigned char *_hinted(self, object digest) noexcept:
        """A hint's digest, or NULL when the zone is closed or it is none."""
        if self._base == NULL or not PyBytes_Check(digest) or PyBytes_GET_SIZE(digest) != DIGEST_SIZE:
            return NULL
        return <const unsigned char *>PyBytes_AS_STRING(digest)

    cdef bint _full(self, sz_stripe *stripe) noexcept:
        """Whether the stripe has no record free (read without the lock)."""
        return sz_load32(&stripe.free_head) == NIL and sz_load32(&stripe.fresh) >= <uint32_t>self.per_stripe

    cdef void _ask_record(self, sz_stripe *stripe, uint32_t index) noexcept:
        """Ask for the memory of the record of ``index`` (a link), every
        line it spans; nothing for NIL or a link out of the stripe."""
        if index == NIL or index > <uint32_t>self.per_stripe:
            return
        cdef unsigned char *at = <unsigned char *>self._record(stripe, index)
        cdef unsigned char *end = at + self.record_size
        while at < end:
            prefetch(at)
            at += 64
        prefetch(end - 1)

    # -- the stripe's structure ----------------------------------------------

    cdef sz_record *_record(self, sz_stripe *stripe, uint32_t index) noexcept:
        """The record of a link (index + 1)."""
        return <sz_record *>(<unsigned char *>stripe + self._records_at + (index - 1) * self.record_size)

    cdef uint32_t *_bucket(self, sz_stripe *stripe, const unsigned char *digest) noexcept:
        cdef uint64_t low
        memcpy(&low, digest + 8, 8)
        return <uint32_t *>(<unsigned char *>stripe + self._buckets_at) + (low & self._bucket_mask)

    cdef Py_ssize_t _length(self, sz_record *record) noexcept:
        return record.length if record.length <= self.value_size else self.value_size

    cdef uint32_t _find(self, sz_stripe *stripe, const unsigned char *digest) noexcept:
        cdef uint32_t at = self._bucket(stripe, digest)[0]
        cdef sz_record *record
        while at != NIL:
            record = self._record(stripe, at)
            if memcmp(record.digest, digest, DIGEST_SIZE) == 0:
                return at
            at = record.chain
        return NIL

    cdef void _write(self, sz_record *record, const unsigned char *digest, bytes value,
                            double expires) noexcept:
        cdef Py_ssize_t length = PyBytes_GET_SIZE(value)
        sz_set_state(record, WRITING)
        memcpy(record.digest, digest, DIGEST_SIZE)
        record.expires = expires
        record.length = <uint16_t>length
        memcpy(<unsigned char *>record + RECORD_HEADER, PyBytes_AS_STRING(value), length)
        sz_set_state(record, LIVE)

    cdef void _replace(self, sz_stripe *stripe, uint32_t index, const unsigned char *digest, bytes value,
                              double expires) noexcept:
        """Write a live record anew, its old contents in the undo copy
        meanwhile: a rebuild after a death halfway puts them back."""
        cdef sz_record *record = self._record(stripe, index)
        memcpy(<unsigned char *>stripe + STRIPE_HEADER, record, self.record_size)
        sz_store32(&stripe.undo, index)
        self._write(record, digest, value, expires)
        sz_store32(&stripe.undo, NIL)

    cdef uint32_t _take(self, sz_stripe *stripe, double now) noexcept:
        cdef uint32_t found = stripe.free_head
        if found != NIL:
            stripe.free_head = self._record(stripe, found).chain
            return found
        if stripe.fresh < <uint32_t>self.per_stripe:
            stripe.fresh += 1
            return stripe.fresh
        found = self._expired_victim(stripe, now)
        if found == NIL:
            found = stripe.oldest
            sz_increment(&self._header.evictions)
        self._remove(stripe, found)
        return found

    cdef uint32_t _expired_victim(self, sz_stripe *stripe, double now) noexcept:
        cdef uint32_t at = stripe.oldest
        cdef int looked
        for looked in range(EXPIRED_SCAN):
            if at == NIL:
                break
            if self._record(stripe, at).expires <= now:
                return at
            at = self._record(stripe, at).newer
        return NIL

    cdef void _remove(self, sz_stripe *stripe, uint32_t index) noexcept:
        """Take a record out of its bucket's chain and the LRU list."""
        cdef sz_record *record = self._record(stripe, index)
        cdef uint32_t *link = self._bucket(stripe, record.digest)
        while link[0] != NIL:
            if link[0] == index:
                link[0] = record.chain
                break
            link = &self._record(stripe, link[0]).chain
        self._unlink_lru(stripe, index)
        stripe.used -= 1

    cdef void _push_free(self, sz_stripe *stripe, uint32_t index) noexcept:
        cdef sz_record *record = self._record(stripe, index)
        sz_set_state(record, FREE)
        record.chain = stripe.free_head
        stripe.free_head = index

    cdef void _unlink_lru(self, sz_stripe *stripe, uint32_t index) noexcept:
        cdef sz_record *record = self._record(stripe, index)
        if record.newer == NIL:
            stripe.newest = record.older
        else:
            self._record(stripe, record.newer).older = record.older
        if record.older == NIL:
            stripe.oldest = record.newer
        else:
            self._record(stripe, record.older).newer = record.newer

    cdef void _link_front(self, sz_stripe *stripe, uint32_t index) noexcept:
        cdef sz_record *record = self._record(stripe, index)
        record.newer = NIL
        record.older = stripe.newest
        if stripe.newest == NIL:
            stripe.oldest = index
        else:
            self._record(stripe, stripe.newest).newer = index
        stripe.newest = index

    cdef void _to_front(self, sz_stripe *stripe, uint32_t index) noexcept:
        if stripe.newest != index:
            self._unlink_lru(stripe, index)
            self._link_front(stripe, index)

    # -- recovery -------------------------------------------------------------

    def _rebuild(self, stripe):
        """Rebuild a locked stripe as recovery does (tests)."""
        self._check_open()
        pure_zone.check_stripes([stripe], self.stripes)
        self._rebuild_stripe(self._locked_stripe(stripe))

    cdef bint _intact(self, sz_record *record) noexcept:
        return record.state == LIVE and record.length <= self.value_size and not isnan(record.expires)

    cdef void _rebuild_stripe(self, sz_stripe *stripe) noexcept:
        """Make a stripe consistent from its live records alone: the twin's
        ``_rebuild``, step for step (read its docstring). No allocation:
        it runs while the stripe's lock is taken over from a dead owner."""
        cdef uint32_t fresh = stripe.fresh if stripe.fresh <= <uint32_t>self.per_stripe else <uint32_t>self.per_stripe
        cdef uint32_t head = NIL, tail = NIL, at, following, index, free = NIL, step
        cdef sz_record *record
        if 1 <= stripe.undo <= fresh:
            memcpy(self._record(stripe, stripe.undo), <unsigned char *>stripe + STRIPE_HEADER, self.record_size)
        stripe.undo = NIL
        for index in range(1, fresh + 1):
            self._record(stripe, index).mark = 0
        at = stripe.newest
        for step in range(fresh):
            if at < 1 or at > fresh:
                break
            record = self._record(stripe, at)
            if record.mark or not self._intact(record):
                break
            following = record.older
            self._keep(stripe, at, &head, &tail)
            at = following
        for index in range(1, fresh + 1):
            record = self._record(stripe, index)
            if not record.mark and self._intact(record):
                self._keep(stripe, index, &head, &tail)
        self._relink(stripe, head)
        for index in range(fresh, 0, -1):
            record = self._record(stripe, index)
            if record.mark:
                record.mark = 0
            else:
                record.state = FREE
                record.chain = free
                free = index
        stripe.free_head = free
        stripe.fresh = fresh

    cdef void _keep(self, sz_stripe *stripe, uint32_t index, uint32_t *head, uint32_t *tail) noexcept:
        cdef sz_record *record = self._record(stripe, index)
        record.mark = 1
        record.chain = NIL
        if tail[0] == NIL:
            head[0] = index
        else:
            self._record(stripe, tail[0]).chain = index
        tail[0] = index

    cdef void _relink(self, sz_stripe *stripe, uint32_t head) noexcept:
        """Buckets, chains and the LRU list anew from the records kept, in
        their order; a digest seen already loses its mark, to be freed."""
        memset(<unsigned char *>stripe + self._buckets_at, 0, (self._bucket_mask + 1) * 4)
        cdef uint32_t newest = NIL, newer = NIL, used = 0, at = head, following
        cdef uint32_t *bucket
        cdef sz_record *record
        while at != NIL:
            record = self._record(stripe, at)
            following = record.chain
            if self._find(stripe, record.digest) != NIL:
                record.mark = 0
            else:
                bucket = self._bucket(stripe, record.digest)
                record.chain = bucket[0]
                bucket[0] = at
                record.newer = newer
                record.older = NIL
                if newer == NIL:
                    newest = at
                else:
                    self._record(stripe, newer).older = at
                newer = at
                used += 1
            at = following
        stripe.newest = newest
        stripe.oldest = newer
        stripe.used = used


@cython.final
cdef class _Held:
    """A ``with`` block holding some stripes' locks."""

    cdef Zone _zone
    cdef object _stripes

    def __cinit__(self, Zone zone, stripes):
        self._zone = zone
        self._stripes = stripes

    def __enter__(self):
        self._zone.lock(self._stripes)
        return None

    def __exit__(self, kind, error, trace):
        self._zone.unlock(self._stripes)
        return False
