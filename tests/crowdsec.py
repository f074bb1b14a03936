"""A real CrowdSec Local API on loopback for the tests (Debian's
``crowdsec`` package): ``crowdsec -no-cs`` runs the API alone (no agent,
no acquisition), with a configuration of its own in a temporary
directory (an SQLite database, no hub, no Central API, no console, no
Prometheus endpoint). ``cscli`` with the same configuration adds its
bouncer key, its machine and the decisions the tests make.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.processes import stop_process

START_SECONDS = 30.0

CONFIG = """\
common:
  daemonize: false
  log_media: file
  log_level: warning
  log_dir: {dir}/log
  working_dir: {dir}
config_paths:
  config_dir: {dir}
  data_dir: {dir}/data
  simulation_path: {dir}/simulation.yaml
  hub_dir: {dir}/hub
  index_path: {dir}/hub/.index.json
  notification_dir: {dir}/notifications
  plugin_dir: {dir}/plugins
cscli:
  output: human
db_config:
  log_level: warning
  type: sqlite
  db_path: {dir}/data/crowdsec.db
  use_wal: false
  flush:
    max_items: 5000
    max_age: 7d
api:
  client:
    credentials_path: {dir}/local_api_credentials.yaml
  server:
    log_level: warning
    listen_uri: 127.0.0.1:{port}
    profiles_path: {dir}/profiles.yaml
    trusted_ips: [127.0.0.1, "::1"]
prometheus:
  enabled: false
"""

PROFILES = """\
name: default_ip_remediation
filters:
 - Alert.Remediation == true && Alert.GetScope() == "Ip"
decisions:
 - type: ban
   duration: 4h
on_success: break
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LocalApi:
    """A Local API in ``directory`` on a free loopback port, until ``stop``."""

    def __init__(self, directory: Path) -> None:
        if shutil.which("crowdsec") is None or shutil.which("cscli") is None:
            raise RuntimeError("crowdsec and cscli are not installed (Debian's crowdsec package: make test "
                               "installs it)")
        self.directory = directory
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        for name in ("log", "data", "hub", "notifications", "plugins"):
            (directory / name).mkdir(parents=True, exist_ok=True)
        (directory / "hub" / ".index.json").write_text("{}\n")
        (directory / "simulation.yaml").write_text("simulation: false\n")
        (directory / "profiles.yaml").write_text(PROFILES)
        self.config = directory / "config.yaml"
        self.config.write_text(CONFIG.format(dir=directory, port=self.port))
        self.process: subprocess.Popen[bytes] | None = None
        self.start()
        # cscli's own decisions and deletions go through the API, as a machine.
        self.cscli("machines", "add", "cscli", "--auto", "--force", "-u", self.url,
                   "-f", str(directory / "local_api_credentials.yaml"))

    # -- the server -----------------------------------------------------------

    def start(self) -> None:
        """Start the API (again, after ``stop``) and wait until it answers."""
        self.process = subprocess.Popen(["crowdsec", "-c", str(self.config), "-no-cs"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                error = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise RuntimeError(f"crowdsec exited with {self.process.returncode}: {error[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/v1/decisions", timeout=1).close()
            except urllib.error.HTTPError:
                return  # it answers (403 without a key)
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"crowdsec did not answer on {self.url} within {START_SECONDS} s")

    def stop(self) -> None:
        stop_process(self.process)
        self.process = None

    # -- cscli ------------------------------------------------------------------

    def cscli(self, *args: str) -> str:
        done = subprocess.run(["cscli", "-c", str(self.config), "--error", *args], capture_output=True,
                              text=True, timeout=30, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"cscli {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def bouncer_key(self, name: str) -> str:
        return self.cscli("bouncers", "add", name, "-o", "raw").strip()

    def add_machine(self, name: str, password: str) -> None:
        self.cscli("machines", "add", name, "--password", password, "--force",
                   "-f", str(self.directory / f"{name}.credentials.yaml"))

    def add_decision(self, value: str, kind: str = "ban", duration: str = "1h") -> None:
        """A decision on an address or a range (a ``/`` in ``value``)."""
        target = "--range" if "/" in value else "--ip"
        self.cscli("decisions", "add", target, value, "--type", kind, "--duration", duration,
                   "--reason", "sluice test")

    def delete_decisions(self, value: str) -> None:
        self.cscli("decisions", "delete", "--range" if "/" in value else "--ip", value)

    def decisions(self) -> list[dict[str, Any]]:
        """The decisions in force, as ``cscli decisions list --all -o json``
        gives them: the alerts, each with its decisions (``--all``: of every
        origin; without it cscli shows only crowdsec's and cscli's own)."""
        found = json.loads(self.cscli("decisions", "list", "--all", "-o", "json") or "null")
        return found or []

    def alerts(self) -> list[dict[str, Any]]:
        found = json.loads(self.cscli("alerts", "list", "--all", "-o", "json") or "null")
        return found or []
