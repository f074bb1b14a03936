# Types of sidecar/engine.py for its compiled build (see setup.py): the
# engine is compiled as it is written; its methods are Python functions.
