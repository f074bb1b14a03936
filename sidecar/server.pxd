# Types of sidecar/server.py for its compiled build (see setup.py): the
# protocol is an extension type, the fields a check reads C fields (the
# rest, and what tests set, in its __dict__), the steps of a check's read
# and answer C methods. uvloop and httptools call its Python methods.
cimport cython


cdef class LimitedHttpProtocol:
    cdef dict __dict__
    cdef object __weakref__
    cdef public object app
    cdef public object loop
    cdef public object server_state
    cdef public object app_state
    cdef public double keep_alive_seconds
    cdef public Py_ssize_t max_header_bytes
    cdef public Py_ssize_t max_headers
    cdef public object checks
    cdef public object doors
    cdef public object parser
    cdef public object client
    cdef public object server
    cdef public object scheme
    cdef public object transport
    cdef public object _head_budget
    cdef public Py_ssize_t _header_count
    cdef public bint _refused
    cdef public bint _between_requests
    cdef public object _linger
    cdef public object _url
    cdef public object _headers
    cdef public bint _expect_continue
    cdef public bint _keep_alive
    cdef public object _scope
    cdef public object _door
    cdef public object _exchange
    cdef public object _responding
    cdef public object _waiting
    cdef public bint read_paused
    cdef public bint write_paused
    cdef public bint _reading_paused_for_writes
    cdef public object _writable
    cdef public object _idle_since
    cdef public object _keep_alive_timer
    cdef dict _scope_template

    @cython.locals(window=Py_ssize_t, start=Py_ssize_t)
    cdef _read_checks(self, bytes data)

    cdef dict _request_scope(self, http_version, method, path, raw_path, query, headers)

    cdef _answer(self, door, dict scope)

    cpdef response_complete(self)
