# Types of sidecar/limiters/token.py for its compiled build (see setup.py).
