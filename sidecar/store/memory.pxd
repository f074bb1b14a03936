# Types of sidecar/store/memory.py for its compiled build (see setup.py).
