# Types of sidecar/bounded.py for its compiled build (see setup.py).
