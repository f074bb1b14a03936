# Types of sidecar/engine.py for its compiled build (see setup.py): the
# engine is compiled as it is written; its methods are Python functions,
# the conclusion's request, checks, specs, hits and evaluation typed (a field
# read in C).
cimport cython

from sidecar.limiters.records cimport Hit
from sidecar.request cimport CheckRequest
from sidecar.state cimport Check, CheckSpec, Evaluation
