# Types of sidecar/keys.py for its compiled build (see setup.py).
