"""The development stack of the repository: `make run`'s launcher and the
demo upstream. Not shipped: the wheel carries the `sidecar` package only."""
