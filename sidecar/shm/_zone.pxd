# The compiled zone's type, for the modules that call it in C (the node
# store: sidecar/store/node.pxd): its C layout (the records, stripes and
# header as the zone file lays them out) and its methods. The zone itself is
# _zone.pyx; its pure-Python twin is pure_zone.py.
cimport cython
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from *:
    """
    #include <pthread.h>
    #include <errno.h>
    #include <stddef.h>
    #include <stdint.h>

    typedef struct {
        unsigned char digest[16];
        double expires;
        uint32_t newer, older, chain;
        uint16_t length;
        uint8_t state, mark;
    } sz_record;

    typedef union { pthread_mutex_t mutex; unsigned char slot[64]; } sz_lock_slot;

    typedef struct {
        sz_lock_slot lock;
        uint32_t newest, oldest, free_head, fresh, used, undo;
    } sz_stripe;

    typedef struct {
        char magic[8];
        uint32_t version, locks, header_size, stripes, per_stripe, value_size, record_size, bucket_count;
        uint64_t stripe_size, file_size;
        uint32_t ready, reserved;
        uint64_t generation, recoveries, evictions, waits;
    } sz_header;

    _Static_assert(sizeof(sz_record) == 40, "a record's header is 40 bytes (pure_zone.RECORD)");
    _Static_assert(sizeof(pthread_mutex_t) <= 64, "a mutex fits its lock slot (pure_zone.LOCK_SLOT)");
    _Static_assert(offsetof(sz_stripe, newest) == 64, "a stripe's fields follow its lock slot");
    _Static_assert(sizeof(sz_stripe) <= 128, "a stripe's header fits pure_zone.STRIPE_HEADER");
    _Static_assert(offsetof(sz_header, ready) == 56, "pure_zone.READY_AT");
    _Static_assert(offsetof(sz_header, generation) == 64, "pure_zone.GENERATION_AT");
    _Static_assert(offsetof(sz_header, waits) == 88, "pure_zone.WAITS_AT");

    /* A mutex in memory that several processes map: robust (the next locker
       learns that its owner died) and error-checking (a thread locking it
       twice is told so instead of waiting for itself). */
    static inline int sz_mutex_init(pthread_mutex_t *mutex) {
        pthread_mutexattr_t attributes;
        int rc = pthread_mutexattr_init(&attributes);
        if (rc) return rc;
        if (!(rc = pthread_mutexattr_setpshared(&attributes, PTHREAD_PROCESS_SHARED))
            && !(rc = pthread_mutexattr_setrobust(&attributes, PTHREAD_MUTEX_ROBUST))
            && !(rc = pthread_mutexattr_settype(&attributes, PTHREAD_MUTEX_ERRORCHECK)))
            rc = pthread_mutex_init(mutex, &attributes);
        pthread_mutexattr_destroy(&attributes);
        return rc;
    }

    /* Whether somebody holds the mutex: glibc keeps the owner's thread id
       in its lock word. Elsewhere, assume so. */
    static inline int sz_mutex_held(pthread_mutex_t *mutex) {
    #ifdef __GLIBC__
        return __atomic_load_n(&mutex->__data.__lock, __ATOMIC_RELAXED) != 0;
    #else
        return 1;
    #endif
    }

    /* A record's state, stored between compiler barriers: the stores before
       it (the record's contents) are not moved after it, nor those after it
       before it, whatever instruction a SIGKILL lands on. */
    static inline void sz_set_state(sz_record *record, uint8_t state) {
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
        __atomic_store_n(&record->state, state, __ATOMIC_RELAXED);
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
    }

    /* A moment's pause in a busy wait: the CPU's hint that this is one. */
    static inline void sz_pause(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #elif defined(__aarch64__)
        __asm__ __volatile__("yield");
    #endif
    }

    static inline uint64_t sz_increment(uint64_t *counter) {
        return __atomic_add_fetch(counter, 1, __ATOMIC_SEQ_CST);
    }

    static inline uint64_t sz_load64(uint64_t *counter) {
        return __atomic_load_n(counter, __ATOMIC_SEQ_CST);
    }

    static inline uint32_t sz_load32(uint32_t *field) {
        return __atomic_load_n(field, __ATOMIC_RELAXED);
    }

    static inline void sz_store32(uint32_t *field, uint32_t value) {
        __atomic_store_n(field, value, __ATOMIC_RELEASE);
    }
    """
    ctypedef struct pthread_mutex_t:
        pass

    ctypedef union sz_lock_slot:
        pthread_mutex_t mutex

    ctypedef struct sz_record:
        unsigned char digest[16]
        double expires
        uint32_t newer, older, chain
        uint16_t length
        uint8_t state, mark

    ctypedef struct sz_stripe:
        sz_lock_slot lock
        uint32_t newest, oldest, free_head, fresh, used, undo

    ctypedef struct sz_header:
        char magic[8]
        uint32_t locks, ready
        uint64_t generation, recoveries, evictions, waits

    int EOWNERDEAD, EDEADLK, ENOTRECOVERABLE

    int pthread_mutex_trylock(pthread_mutex_t *mutex) nogil
    int pthread_mutex_lock(pthread_mutex_t *mutex) nogil
    int pthread_mutex_unlock(pthread_mutex_t *mutex) nogil
    int pthread_mutex_consistent(pthread_mutex_t *mutex) nogil
    int sz_mutex_init(pthread_mutex_t *mutex) nogil
    bint sz_mutex_held(pthread_mutex_t *mutex) nogil
    void sz_set_state(sz_record *record, uint8_t state) nogil
    void sz_pause() nogil
    uint64_t sz_increment(uint64_t *counter) nogil
    uint64_t sz_load64(uint64_t *counter) nogil
    uint32_t sz_load32(uint32_t *field) nogil
    void sz_store32(uint32_t *field, uint32_t value) nogil



@cython.final
cdef class Zone:
    cdef unsigned char *_base
    cdef size_t _mapped
    cdef sz_header *_header
    cdef readonly object path
    cdef readonly Py_ssize_t capacity, value_size, stripes, per_stripe, record_size, file_size
    cdef Py_ssize_t _stripe_size, _buckets_at, _records_at
    cdef uint64_t _bucket_mask
    cdef Py_ssize_t _held  # locks this object holds or waits for, every thread together

    cpdef Py_ssize_t stripe_of(self, digest) except -1
    cpdef lock(self, stripes)
    cpdef unlock(self, stripes)
    cpdef lock_mask(self, unsigned long long mask)
    cpdef unlock_mask(self, unsigned long long mask)
    cpdef get(self, digest, double now)
    cpdef peek(self, digest, double now)
    cpdef put(self, digest, value, double expires, double now)
    cpdef delete(self, digest)
    cpdef generation(self)
    cpdef ask(self, digest)
    cpdef ask_records(self, digest)
    cpdef ask_victim(self, digest)

    cdef int _map(self, int fd, object found, object path) except -1
    cdef int _make(self, object found) except -1
    cdef void _unmap(self) noexcept
    cdef int _check_open(self) except -1
    cdef sz_stripe *_stripe(self, Py_ssize_t stripe) noexcept
    cdef Py_ssize_t _stripe_index(self, const unsigned char *digest) noexcept
    cdef sz_stripe *_locked_stripe(self, Py_ssize_t stripe) except NULL
    cdef int _check_stripes(self, object stripes) except -1
    cdef int _check_mask(self, unsigned long long mask) except -1
    cdef int _release_mask(self, unsigned long long mask) except -1
    cdef object _release_noting(self, Py_ssize_t stripe, object error)
    cdef int _acquire(self, Py_ssize_t stripe) except -1
    cdef int _release(self, Py_ssize_t stripe) except -1
    cdef object _read(self, object digest, double now, bint refresh)
    cdef const unsigned char *_hinted(self, object digest) noexcept
    cdef bint _full(self, sz_stripe *stripe) noexcept
    cdef void _ask_record(self, sz_stripe *stripe, uint32_t index) noexcept
    cdef sz_record *_record(self, sz_stripe *stripe, uint32_t index) noexcept
    cdef uint32_t *_bucket(self, sz_stripe *stripe, const unsigned char *digest) noexcept
    cdef Py_ssize_t _length(self, sz_record *record) noexcept
    cdef uint32_t _find(self, sz_stripe *stripe, const unsigned char *digest) noexcept
    cdef void _write(self, sz_record *record, const unsigned char *digest, bytes value,
                 double expires) noexcept
    cdef void _replace(self, sz_stripe *stripe, uint32_t index, const unsigned char *digest, bytes value,
                   double expires) noexcept
    cdef uint32_t _take(self, sz_stripe *stripe, double now) noexcept
    cdef uint32_t _expired_victim(self, sz_stripe *stripe, double now) noexcept
    cdef void _remove(self, sz_stripe *stripe, uint32_t index) noexcept
    cdef void _push_free(self, sz_stripe *stripe, uint32_t index) noexcept
    cdef void _unlink_lru(self, sz_stripe *stripe, uint32_t index) noexcept
    cdef void _link_front(self, sz_stripe *stripe, uint32_t index) noexcept
    cdef void _to_front(self, sz_stripe *stripe, uint32_t index) noexcept
    cdef bint _intact(self, sz_record *record) noexcept
    cdef void _rebuild_stripe(self, sz_stripe *stripe) noexcept
    cdef void _keep(self, sz_stripe *stripe, uint32_t index, uint32_t *head, uint32_t *tail) noexcept
    cdef void _relink(self, sz_stripe *stripe, uint32_t head) noexcept
