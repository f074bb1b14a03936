# Types of sidecar/clientip.py for its compiled build (see setup.py): its
# classes stay Python classes; the resolver's walk and the fast paths of
# IPv4 and IPv6 text are compiled.
