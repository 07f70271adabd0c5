"""Brokers for one machine: the embedded amqtt broker and a local Mosquitto from broker/ templates.

`EmbeddedBroker` runs amqtt (pure Python, MQTT 3.1.1 only, no authentication, no packet size
limit) on a background thread with its own asyncio loop: fine for a laptop fleet and tests,
about 4x slower than Mosquitto on multi-MB messages. `start_mosquitto` renders
broker/mosquitto-test.conf.template and broker/acl.template into a temp dir and starts the
`mosquitto` binary on a free port with the same ACL as production.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amqtt.broker import Broker
from amqtt.plugins.base import BaseAuthPlugin
from amqtt.session import Session

from edgefcl.transport.port_owner import port_owner
from edgefcl.transport.topics import validate_id
from edgefcl.transport.transport_error import TransportError

log = logging.getLogger(__name__)

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "broker"
"""The broker/ folder of the source tree (mosquitto.conf, acl.template, test template)."""


class OpenAuthPlugin(BaseAuthPlugin):
    """amqtt auth plugin accepting every client as a named (non-anonymous) session.

    amqtt drops the offline queue of anonymous sessions; this plugin keeps persistent sessions
    (clean_session=False) working so QoS 1 messages wait for offline subscribers.
    """

    @dataclass
    class Config:
        """No options."""

    async def authenticate(self, *, session: Session) -> bool:
        return True

    async def on_broker_client_connected(self, *, client_id: str, client_session: Session,
                                         **_: Any) -> None:
        log.info("client %s connected", client_id)

    async def on_broker_client_disconnected(self, *, client_id: str, client_session: Session,
                                            **_: Any) -> None:
        log.info("client %s disconnected", client_id)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port(host: str, port: int, timeout: float = 10.0) -> bool:
    """Wait until something accepts TCP connections on host:port; False after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def _log_broker_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """One log line instead of asyncio's traceback. amqtt 0.12 can drop a connection when
    clients connect while others subscribe (it iterates a dict that changes); the client
    reconnects with its persistent session, so this is not an error of the fleet."""
    exc = context.get("exception")
    log.info("embedded broker dropped a connection (%s: %s); the client reconnects",
             type(exc).__name__ if exc else "error", exc or context.get("message"))


class EmbeddedBroker:
    """amqtt broker on a background thread; `port=0` picks a free port.

    Use as a context manager, or call `start()` / `stop()`. `url` is `mqtt://host:port`.
    """

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, session_expiry: int = 24 * 3600
    ) -> None:
        self.host = host
        self.port = port
        self.session_expiry = session_expiry
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: Broker | None = None

    @property
    def url(self) -> str:
        """`mqtt://host:port` of the running broker."""
        return f"mqtt://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._broker is not None

    def _config(self) -> dict[str, Any]:
        return {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            "session_expiry_interval": self.session_expiry,
            "plugins": {f"{__name__}.OpenAuthPlugin": {}},
        }

    async def _start(self) -> Broker:
        broker = Broker(self._config(), loop=asyncio.get_running_loop())
        await broker.start()
        return broker

    def start(self, timeout: float = 10.0) -> EmbeddedBroker:
        """Start listening; raises TransportError if the broker cannot start."""
        if self._broker is not None:
            return self
        amqtt_log = logging.getLogger("amqtt")
        if amqtt_log.level == logging.NOTSET:  # its per-connection warnings are noise here
            amqtt_log.setLevel(logging.ERROR)
        # amqtt's state machine logs every transition of every session at INFO
        logging.getLogger("transitions").setLevel(logging.WARNING)
        level, amqtt_log.level = amqtt_log.level, logging.CRITICAL  # start-up errors: ours
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(_log_broker_error)
        thread = threading.Thread(target=loop.run_forever, name="edgefcl-broker", daemon=True)
        thread.start()
        try:
            broker = asyncio.run_coroutine_threadsafe(self._start(), loop).result(timeout)
        except Exception as e:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)
            loop.close()
            why = str(e).rsplit(": ", 1)[-1] or type(e).__name__  # amqtt wraps the OSError
            owner = port_owner(self.port) if self.port else None
            if owner:
                why += (f" by {owner}; use that broker (--broker mqtt://{self.host}:{self.port})"
                        " or pick another port with --port")
            raise TransportError(
                f"embedded MQTT broker could not listen on {self.host}:{self.port}: {why}"
            ) from None
        finally:
            amqtt_log.setLevel(level)
        self._loop, self._thread, self._broker = loop, thread, broker
        server = broker._servers["default"].instance  # amqtt keeps no public accessor
        self.port = server.sockets[0].getsockname()[1]
        log.info("embedded MQTT broker on %s", self.url)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the broker down and join its thread."""
        if self._broker is None or self._loop is None or self._thread is None:
            return
        loop, broker = self._loop, self._broker
        self._broker = None
        try:
            asyncio.run_coroutine_threadsafe(broker.shutdown(), loop).result(timeout)
        except Exception as e:  # never let a shutdown hiccup mask the caller's own error
            log.warning("embedded broker shutdown: %s", e)

        async def _cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_cancel_rest(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout)
        loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------- mosquitto


def render_acl(
    fleet: str, root: str = "edgefcl", aggregator: str = "aggregator",
    replayer: str = "replayer", operator: str = "operator",
    template: Path | None = None,
) -> str:
    """broker/acl.template filled in for one fleet."""
    for name, what in ((fleet, "fleet id"), (aggregator, "aggregator user"),
                       (replayer, "replayer user"), (operator, "operator user")):
        validate_id(name, what)
    text = (template or _template("acl.template", None)).read_text()
    subs = {"@ROOT@": root, "@FLEET@": fleet, "@AGGREGATOR@": aggregator,
            "@REPLAYER@": replayer, "@OPERATOR@": operator}
    for k, v in subs.items():
        text = text.replace(k, v)
    return text


def render_bridge(fleet: str, site: str, central: str, root: str = "edgefcl",
                  template: Path | None = None) -> str:
    """broker/bridge.conf.example filled in: the bridge of site aggregator `site`'s broker to
    the central broker at `central` (host:port)."""
    validate_id(fleet, "fleet id")
    validate_id(site, "site id")
    text = (template or _template("bridge.conf.example", None)).read_text()
    for k, v in {"@ROOT@": root, "@FLEET@": fleet, "@SITE@": site, "@CENTRAL@": central}.items():
        text = text.replace(k, v)
    return text


def add_mosquitto_user(path: str | Path, user: str, password: str) -> None:
    """Add or update `user` in a Mosquitto password file (with mosquitto_passwd)."""
    tool = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
    if not Path(tool).exists():
        raise TransportError("mosquitto_passwd not found; install the mosquitto package")
    validate_id(user, "username")
    res = subprocess.run(
        [tool, "-b", str(path), user, password], capture_output=True, text=True, timeout=30
    )
    if res.returncode != 0:
        raise TransportError(f"mosquitto_passwd failed for {user!r}: {res.stderr.strip()}")


def _mosquitto_passwd(path: Path, users: dict[str, str]) -> None:
    for user, pw in users.items():
        add_mosquitto_user(path, user, pw)


class MosquittoProcess(subprocess.Popen):
    """A running `mosquitto` started by `start_mosquitto`; `url`, `port`, `config_dir`, `log`."""

    url: str
    port: int
    host: str
    config_dir: Path
    log: Path

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate (then kill) the broker."""
        if self.poll() is None:
            self.terminate()
            try:
                self.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                self.wait(timeout)

    def reload(self) -> None:
        """Make Mosquitto re-read its password and ACL files (SIGHUP)."""
        self.send_signal(signal.SIGHUP)


def _template(name: str, template_dir: Path | None) -> Path:
    path = (template_dir or TEMPLATE_DIR) / name
    if not path.exists():
        raise TransportError(
            f"broker template {path} not found; run from an edgefcl source checkout or pass "
            "template_dir= pointing at its broker/ folder"
        )
    return path


def start_mosquitto(
    port: int = 0,
    config_dir: str | Path | None = None,
    *,
    host: str = "127.0.0.1",
    fleet: str = "test",
    root: str = "edgefcl",
    users: dict[str, str] | None = None,
    allow_anonymous: bool = False,
    binary: str | None = None,
    template_dir: Path | None = None,
    extra_conf: str = "",
    timeout: float = 10.0,
) -> MosquittoProcess:
    """Render broker/mosquitto-test.conf.template into `config_dir` and start Mosquitto.

    `port=0` picks a free port; `users` maps usernames to passwords (written with
    mosquitto_passwd); the ACL is broker/acl.template rendered for `fleet`. With
    `allow_anonymous` no password file or ACL is used. `extra_conf` is appended to the config
    (e.g. a TLS listener). The broker logs to
    `<config_dir>/mosquitto.log`. Raises TransportError if Mosquitto does not come up.
    """
    exe = binary or shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(exe).exists():
        raise TransportError(
            "mosquitto binary not found; install it (apt-get install mosquitto) or use "
            "the embedded broker (`edgefcl broker`)"
        )
    template = _template("mosquitto-test.conf.template", template_dir).read_text()
    cdir = Path(config_dir) if config_dir else Path(tempfile.mkdtemp(prefix="edgefcl-mosq-"))
    cdir.mkdir(parents=True, exist_ok=True)
    auth = "allow_anonymous true"
    if not allow_anonymous:
        acl = render_acl(fleet, root, template=_template("acl.template", template_dir))
        (cdir / "acl").write_text(acl)
        passwd = cdir / "passwd"
        passwd.write_text("")
        if users:
            _mosquitto_passwd(passwd, users)
        auth = f"allow_anonymous false\npassword_file {passwd}\nacl_file {cdir / 'acl'}"
    logfile = cdir / "mosquitto.log"
    p = port
    for _ in range(3):  # a free port can be taken between probing and binding
        p = port or free_port(host)
        conf = (
            template.replace("@PORT@", str(p)).replace("@HOST@", host)
            .replace("@AUTH@", auth).replace("@USER@", getpass.getuser())
        ) + extra_conf
        (cdir / "mosquitto.conf").write_text(conf)
        with open(logfile, "ab") as err:
            proc = MosquittoProcess(
                [exe, "-c", str(cdir / "mosquitto.conf")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            )
        proc.url, proc.port, proc.host = f"mqtt://{host}:{p}", p, host
        proc.config_dir, proc.log = cdir, logfile
        if wait_port(host, p, timeout) and proc.poll() is None:
            return proc
        proc.stop()
        if port:
            break
    tail = logfile.read_text(errors="replace")[-2000:].strip()
    raise TransportError(f"mosquitto did not start on {host}:{p}: {tail}")
