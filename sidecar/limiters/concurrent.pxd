# Types of sidecar/limiters/concurrent.py for its compiled build (see setup.py).
