# Types of sidecar/limiters/window.py for its compiled build (see setup.py).
