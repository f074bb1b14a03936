# Types of sidecar/store/local.py for its compiled build (see setup.py).
