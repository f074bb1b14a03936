# Types of sidecar/engine.py for its compiled build (see setup.py): the
# engine is an extension type whose fields a check reads are C fields (the
# rest, and what tests set, in its __dict__); the steps of a decision are C
# methods, the conclusion's request, checks, specs, hits and evaluation
# typed (a field read in C). decide_now stays a Python method: tests and
# tools replace it on an engine.
cimport cython

from sidecar._statemap cimport StateMap
from sidecar.clientip cimport ClientAddress, ClientIPResolver
from sidecar.latency cimport RuleSetCount, Tally as Counter  # engine.py has a Tally of its own (the RLS door's)
from sidecar.limiters.records cimport Hit
from sidecar.matching cimport Program
from sidecar.policy cimport Policy, TableInC
from sidecar.request cimport CheckRequest
from sidecar.state cimport Check, CheckSpec, Evaluation


cdef class Engine:
    cdef dict __dict__
    cdef public object store
    cdef public object metrics
    cdef Counter _checks
    cdef public object clock
    cdef public object wall_clock
    cdef public object log
    cdef public object tokens
    cdef public object refusals
    cdef public object late_counts
    cdef public object loop_behind
    cdef public object address_refusals
    cdef public Py_ssize_t delayed
    cdef object _credential_check
    # The ruleset (the ruleset property) and what every check reads of it.
    cdef object _ruleset
    cdef object _match
    cdef Program _program
    cdef ClientIPResolver _resolver
    cdef object _exempt
    cdef object _crowdsec
    cdef bint _exempting
    cdef bint _holds
    cdef bint _leases
    cdef bint _draft_headers
    cdef object _plain_for
    cdef object _plain
    cdef Policy _policy
    cdef TableInC _table
    cdef Policy _table_policy
    cdef object _table_bans
    cdef list _counted_ids
    cdef RuleSetCount _counted

    @cython.locals(resolver=ClientIPResolver, client=ClientAddress)
    cdef _resolve(self, CheckRequest request)

    @cython.locals(client=ClientAddress, program=Program, ended=bint, states=StateMap, table=TableInC)
    cdef _prepare(self, CheckRequest request)

    cdef _learn_store(self, store)

    @cython.locals(policy=Policy, evaluation=Evaluation, table=TableInC, table_policy=Policy)
    cdef _evaluate_now(self, store, double now, client, checks, bint can_delay, bint quotas)

    @cython.locals(count=RuleSetCount)
    cdef _count_rules(self, list ids)

    @cython.locals(hit=Hit, check=Check, spec=CheckSpec, hits=list, index=Py_ssize_t)
    cdef _conclude(self, CheckRequest request, list matched, list checks, Evaluation evaluation)
