# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Memory for the limiters' states, each in one line of the CPU's cache.

Python's allocator puts a 64-byte object across two lines of 64 bytes: its
pools start their blocks 48 bytes in. Under a rotation of clients every
key stored is a new state and every key evicted releases one, each from
memory long out of the cache, so each costs twice the misses it would in
one line. ``place_in_lines`` gives a type's instances blocks of 64 bytes
aligned on a line, carved from chunks of the raw allocator (which
tracemalloc counts) and kept for the next instance when released: never
more memory than the most instances alive at once, as the map's records.

Only for a type of Sluice's whose instances fit in 64 bytes, have no
items and are not tracked by the garbage collector, and before it has any
instance: each limiter module places its state's type right after the
class, as an instance made by the usual allocator must not come back to
this one. The pure-Python core keeps Python's allocator: nothing here
changes what an instance holds or does.
"""

from cpython.mem cimport PyMem_RawMalloc, PyMem_RawRealloc
from cpython.object cimport PyObject, PyTypeObject
from libc.stdint cimport uintptr_t
from libc.string cimport memset


cdef extern from *:
    # GCC's and Clang's: ask for a line of memory before it is read.
    void prefetch "__builtin_prefetch"(const void *address, int write) noexcept nogil


cdef extern from "Python.h":
    ctypedef PyObject *(*allocfunc)(PyTypeObject *, Py_ssize_t)
    ctypedef void (*freefunc)(void *)
    ctypedef struct PyTypeObjectSlots "PyTypeObject":
        Py_ssize_t tp_basicsize
        Py_ssize_t tp_itemsize
        unsigned long tp_flags
        allocfunc tp_alloc
        freefunc tp_free
    PyObject *PyObject_Init(PyObject *op, PyTypeObject *tp)
    PyObject *no_memory "PyErr_NoMemory"()
    unsigned long Py_TPFLAGS_HAVE_GC


cdef enum:
    LINE = 64  # bytes of a line of the cache, and of a block
    CHUNK_BLOCKS = 127  # blocks carved from one allocation (8 KiB with its alignment)
    # Blocks ahead on the stack of released ones whose memory a new
    # instance asks for (a rotation stores about eight states a request).
    FETCHED_AHEAD = 4


# The blocks released, for the next instances, the last released on top:
# a stack as large as the blocks carved, so that releasing one never
# allocates. An array and not a list through the blocks, whose next would
# be read from a block long out of the cache: the blocks a few instances
# ahead are known without reading any, and their memory asked for.
cdef void **released = NULL
cdef Py_ssize_t stacked = 0  # blocks on the stack
cdef Py_ssize_t blocks = 0  # blocks carved, and room on the stack
cdef char *carving = NULL  # the chunk being carved
cdef Py_ssize_t carved = CHUNK_BLOCKS  # blocks of it given out


cdef PyObject *allocate(PyTypeObject *kind, Py_ssize_t items) noexcept:
    global released, stacked, blocks, carving, carved
    cdef void *block
    cdef char *raw
    cdef void **stack
    if stacked > 0:
        stacked -= 1
        block = released[stacked]
        if stacked >= FETCHED_AHEAD:
            # A coming state's block, released when room was last made and
            # out of the nearer caches by now: asked for (to be written).
            prefetch(released[stacked - FETCHED_AHEAD], 1)
    else:
        if carved == CHUNK_BLOCKS:
            stack = <void **>PyMem_RawRealloc(released, (blocks + CHUNK_BLOCKS) * sizeof(void *))
            if stack == NULL:
                return no_memory()
            released = stack
            raw = <char *>PyMem_RawMalloc((CHUNK_BLOCKS + 1) * LINE)
            if raw == NULL:
                return no_memory()
            blocks += CHUNK_BLOCKS
            carving = <char *>((<uintptr_t>raw + LINE - 1) & ~(<uintptr_t>LINE - 1))
            carved = 0
        block = carving + carved * LINE
        carved += 1
    memset(block, 0, LINE)
    return PyObject_Init(<PyObject *>block, kind)


cdef void release(void *block) noexcept:
    global stacked
    released[stacked] = block
    stacked += 1


cdef bint fits(PyTypeObjectSlots *slots) noexcept:
    """Whether a type's instances fit a block and the collector never tracks them."""
    return slots.tp_basicsize <= LINE and slots.tp_itemsize == 0 and not slots.tp_flags & Py_TPFLAGS_HAVE_GC


def place_in_lines(kind):
    """Give ``kind``'s instances a line of the cache each (see the module)."""
    if not isinstance(kind, type) or not kind.__module__.startswith("sidecar.") \
            or not fits(<PyTypeObjectSlots *><PyObject *>kind):
        raise TypeError(f"{kind!r}: not an untracked type of Sluice's, of fixed instances of at most {LINE} bytes")
    cdef PyTypeObjectSlots *slots = <PyTypeObjectSlots *><PyObject *>kind
    slots.tp_alloc = allocate
    slots.tp_free = release
