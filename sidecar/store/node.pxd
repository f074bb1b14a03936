# Types of sidecar/store/node.py for its compiled build (see setup.py): a
# transaction's table and its slots are extension types, so that a
# decision's reads and writes of the zones cost few Python calls.
cimport cython

from sidecar.bounded cimport SeenLately
from sidecar.keystate cimport limiter_of
from sidecar.limiters.records cimport Algorithm
from sidecar.shm._zone cimport Zone as CompiledZone
from sidecar.policy cimport Policy, TableInC
from sidecar.state cimport Check, CheckSpec, Evaluation
from sidecar.store.records cimport Namer, encode_state


@cython.locals(check=Check, spec=CheckSpec)
cpdef bint over_slots(checks, Py_ssize_t slots) except -1
@cython.locals(old=tuple, new=tuple, index=Py_ssize_t)
cpdef bint same_key(planned, key) except -1
@cython.locals(bit="unsigned long long")
cpdef unsigned long long stripe_bit(Py_ssize_t stripe)


@cython.final
cdef class _Name:
    cdef public bytes digest
    cdef public bytes text
    cdef public bytes prefix_text
    cdef public bint leases
    cdef public Py_ssize_t room
    cdef public bint labelled
    cdef public Py_ssize_t stripe
    cdef public Py_ssize_t label_stripe
    cdef public Py_ssize_t planned
    cdef public Py_ssize_t slot
    cdef public bint kept


@cython.locals(name=_Name)
cpdef _Name new_name(bytes digest, bytes text, bytes prefix_text, bint leases, Py_ssize_t room, Py_ssize_t stripe,
                     Py_ssize_t label_stripe)


@cython.final
cdef class _Slot:
    cdef public object key
    cdef public bytes digest
    cdef public object zone
    cdef public CompiledZone compiled
    cdef public Py_ssize_t value_size
    cdef public object limiter
    cdef public bytes text
    cdef public Py_ssize_t room
    cdef public bint labelled
    cdef public object prefix
    cdef public object state
    cdef public bytes raw
    cdef public bint read
    cdef public bint changed
    cdef public bint forgotten
    cdef public object kept_digest
    cdef public object kept_value
    cdef public object kept_state
    cdef public object last_key
    cdef public _Name last_name

    cpdef keep_decoded(self, bytes value, state)
    cpdef decoded(self, bytes value)
    cpdef plan(self, key, _Name name, zone, Py_ssize_t value_size, limiter, prefix, CompiledZone compiled)
    cpdef clear(self)


cdef class NodeTable(TableInC):
    cdef public object zones
    cdef public double now
    cdef public Py_ssize_t _transaction
    cdef public list _slots
    cdef public Py_ssize_t _used
    cdef public Py_ssize_t _found
    cdef public dict _bans
    cdef public dict _notes
    cdef public dict _names
    cdef public SeenLately _seen
    cdef public Py_ssize_t _names_generation
    cdef public dict _ban_names
    cdef public set _known_prefixes
    cdef public unsigned long long _ban_mask
    cdef public unsigned long long _note_mask
    cdef public unsigned long long _state_mask
    cdef public unsigned long long _lease_mask
    cdef public unsigned long long _label_mask
    cdef public unsigned long long _prefix_mask
    cdef public list _locking
    cdef public list _compiled_locking
    cdef public list _locked_masks
    cdef public Py_ssize_t _held
    cdef public object _states
    cdef public object _leases
    cdef public object _labels
    cdef public Py_ssize_t _state_value_size
    cdef public Py_ssize_t _lease_value_size
    cdef public Py_ssize_t lease_slots
    cdef public Namer _namer
    cdef public CompiledZone _compiled_states
    cdef public CompiledZone _compiled_leases
    cdef public CompiledZone _compiled_bans
    cdef public object bans_seen
    cdef public object catching_up
    cdef public dict _capped

    @cython.locals(compiled=CompiledZone)
    cpdef bans_generation(self)

    @cython.locals(seen=SeenLately)
    cpdef begin(self, double now)
    @cython.locals(slot=_Slot, name=_Name, last=_Name, value_size=Py_ssize_t, compiled=CompiledZone, index=Py_ssize_t,
                   digest=bytes, slots=list, counts_leases=bint)
    cpdef _Slot plan_key(self, key, limiter, leases=*)
    @cython.locals(named=tuple, compiled=CompiledZone, stripe=Py_ssize_t)
    cpdef plan_ban(self, address)
    cpdef plan_note(self, name)
    @cython.locals(check=Check, spec=CheckSpec)
    cpdef plan_checks(self, address, checks)
    @cython.locals(slot=_Slot, slots=list, index=Py_ssize_t, labelled=bint, now=double, expires=double,
                   kept=double, compiled=CompiledZone, limiter=Algorithm, value=bytes, text=bytes, never=double,
                   stale_kept=double)
    cpdef _commit(self)
    cpdef bint catch_up(self) except -1
    cpdef Evaluation decide(self, policy, double now, address, checks, bint can_delay, bint quotas)
    @cython.locals(slot=_Slot, slots=list, index=Py_ssize_t, compiled=CompiledZone, bans=CompiledZone, entry=list)
    cpdef _ask_records(self)
    @cython.locals(can_delay=bint, quotas=bint)
    cdef _transact(self, Policy policy, action, tuple args)
    @cython.locals(masks=list, index=Py_ssize_t)
    cpdef _lock(self)
    @cython.locals(masks=list, index=Py_ssize_t)
    cpdef _unlock(self)
    @cython.locals(compiled=CompiledZone)
    cdef int _lock_zone(self, Py_ssize_t index, unsigned long long mask, bint lock) except -1
    @cython.locals(slot=_Slot, slots=list, index=Py_ssize_t, used=Py_ssize_t, _step=Py_ssize_t, name=_Name,
                   compiled=CompiledZone)
    cpdef _Slot _slot(self, key)
    # The policy's primitives, called in C by the compiled policy (TableInC).
    cpdef state(self, key)
    @cython.locals(slot=_Slot)
    cpdef keep(self, key, state)
    cpdef expect(self, checks)
    @cython.locals(entry=list, compiled=CompiledZone, digest=bytes, now=double)
    cpdef ban(self, address)
    @cython.locals(slot=_Slot, slots=list, index=Py_ssize_t)
    cpdef _drop_decoded(self)
    @cython.locals(slot=_Slot, slots=list, index=Py_ssize_t)
    cpdef _end(self)
    @cython.locals(name=_Name, room=Py_ssize_t, compiled=CompiledZone, text=bytes, digest=bytes, stripe=Py_ssize_t,
                   label_stripe=Py_ssize_t)
    cpdef _Name _name(self, key, bint leases)
    @cython.locals(seen=SeenLately)
    cdef bint _named_before(self, bytes digest) except -1
