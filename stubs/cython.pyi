# What mypy knows of Cython's pure-Python mode: the names the package uses,
# as sidecar/purecython.py defines them for the pure-Python core, so that a
# function decorated with @cython.locals keeps its signature.
from typing import TypeVar

from sidecar.purecython import cclass as cclass
from sidecar.purecython import compiled as compiled
from sidecar.purecython import declare as declare
from sidecar.purecython import double as double
from sidecar.purecython import freelist as freelist
from sidecar.purecython import locals as locals
from sidecar.purecython import longlong as longlong
from sidecar.purecython import no_gc as no_gc
from sidecar.purecython import union as union

_T = TypeVar("_T")


def cast(kind: type[_T], value: object) -> _T: ...
