"""Sluice: a rate-limiting external authorization sidecar for nginx and Envoy."""

__version__ = "0.1.0"
