"""Sluice: a rate-limiting external authorization sidecar for nginx and Envoy."""

import functools

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
