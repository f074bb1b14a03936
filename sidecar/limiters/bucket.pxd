# Types of sidecar/limiters/bucket.py for its compiled build (see setup.py).
