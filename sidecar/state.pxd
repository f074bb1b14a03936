# Types of sidecar/state.py for its compiled build (see setup.py).
