# Types of sidecar/policy.py for its compiled build (see setup.py).
