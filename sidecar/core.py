"""Which core runs: the compiled modules or their pure-Python twins, decided once at import.

The compiled core is built by Cython from the very same ``.py`` files; until
the build and its manifest exist, the pure-Python core runs.
"""

import os

PURE_ENV = "SLUICE_PURE_PYTHON"


def _decide() -> tuple[bool, str]:
    """Whether the pure-Python core runs, and the words that say which core and why."""
    if os.environ.get(PURE_ENV) == "1":
        return True, f"pure-Python core ({PURE_ENV}=1)"
    return True, "pure-Python core (not built)"


PURE, _WHICH = _decide()


def which() -> str:
    """The core this process runs, in words (``sluice --version``)."""
    return _WHICH
