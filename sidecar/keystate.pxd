# Types of sidecar/keystate.py for its compiled build (see setup.py):
# a state's limiter read as a field of its type.
cimport cython

from sidecar.limiters.concurrent cimport LeaseState
from sidecar.limiters.leaky cimport LeakyState
from sidecar.limiters.token cimport TokenState
from sidecar.limiters.window cimport WindowState


@cython.locals(window=WindowState, token=TokenState, leaky=LeakyState, lease=LeaseState)
cpdef object limiter_of(object state)
