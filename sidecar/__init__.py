"""Sluice: a rate-limiting external authorization sidecar for nginx and Envoy."""

import functools

from sidecar import core

# The compiled core, or the pure-Python one: chosen once, here (sidecar.core).
core.install()

DISTRIBUTION = "sluice-ratelimit"


@functools.cache
def version() -> str:
    """The installed distribution's version (``sluice --version``, ``sluice_build_info``)."""
    # Imported here: importlib.metadata costs every command's start otherwise.
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(DISTRIBUTION)
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"
