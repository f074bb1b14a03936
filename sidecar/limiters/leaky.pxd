# Types of sidecar/limiters/leaky.py for its compiled build (see setup.py).
