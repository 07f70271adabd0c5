"""The production broker set-up as shipped: broker/mosquitto.conf (only the port and the
paths changed), users made by broker/add-device.sh, the ACL from broker/acl.template."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from edgefcl.transport.broker import free_port, render_acl, wait_port
from edgefcl.transport.codec import Message, encode
from edgefcl.transport.mqtt import BrokerUnavailable, MqttLink
from edgefcl.transport.topics import Topics

pytestmark = pytest.mark.mqtt

REPO = Path(__file__).resolve().parents[2]
FLEET = "prod"
T = Topics(FLEET)
USERS = ("aggregator", "operator", "replayer", "dev1", "dev2", "dev3", "dev4")


def _production_conf(port: int, d: Path, second: int | None = None) -> str:
    """The shipped configuration on `port`; with `second`, its TLS listener uncommented as
    an operator would, on that port, without the TLS lines (no certificates here)."""
    conf = (REPO / "broker" / "mosquitto.conf").read_text()
    conf = conf.replace("listener 1883", f"listener {port} 127.0.0.1")
    if second is not None:
        conf = conf.replace("#listener 8883", f"listener {second} 127.0.0.1")
        conf = conf.replace("#protocol mqtt", "protocol mqtt")
        conf = conf.replace("#use_username_as_clientid", "use_username_as_clientid")
    conf = conf.replace("/etc/mosquitto/edgefcl/", f"{d}/")
    conf = conf.replace("persistence_location /var/lib/mosquitto/",
                        f"persistence_location {d}/data/")
    active = [ln for ln in conf.splitlines() if not ln.startswith("#")]
    assert sum(str(d) in ln for ln in active) == 3, "the shipped paths changed; update this test"
    return conf


@pytest.fixture
def production_broker(request):
    exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(exe).exists() or shutil.which("mosquitto_passwd") is None:
        pytest.skip("mosquitto / mosquitto_passwd are not installed")
    # a directory the `mosquitto` user can traverse (the broker drops to it when run as root)
    d = Path(tempfile.mkdtemp(prefix="edgefcl-prod-"))
    d.chmod(0o755)
    (d / "data").mkdir()
    if os.geteuid() == 0:
        shutil.chown(d / "data", "mosquitto", "mosquitto")
    (d / "acl").write_text(render_acl(FLEET, "edgefcl",
                                      template=REPO / "broker" / "acl.template"))
    env = {**os.environ, "EDGEFCL_PASSWD": str(d / "passwd"), "EDGEFCL_ACL": str(d / "acl")}
    passwords = {}
    for user in USERS:
        out = subprocess.run([str(REPO / "broker" / "add-device.sh"), FLEET, user], env=env,
                             capture_output=True, text=True, check=True)
        passwords[user] = re.search(r"^password: (\S+)$", out.stdout, re.M).group(1)
    port = free_port()
    second = free_port() if getattr(request, "param", None) == "two listeners" else None
    (d / "mosquitto.conf").write_text(_production_conf(port, d, second))
    log = open(d / "mosquitto.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([exe, "-c", str(d / "mosquitto.conf")], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log)
    try:
        up = wait_port("127.0.0.1", port, 10) and proc.poll() is None
        assert up, (d / "mosquitto.log").read_text()[-2000:]
        yield f"mqtt://127.0.0.1:{port}", passwords, d
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        shutil.rmtree(d, ignore_errors=True)


def test_password_file_is_readable_by_the_broker_group(production_broker) -> None:
    _, _, d = production_broker
    st = (d / "passwd").stat()
    assert stat.S_IMODE(st.st_mode) == 0o640
    if os.geteuid() == 0:
        import grp

        assert st.st_uid == 0 and grp.getgrgid(st.st_gid).gr_name == "mosquitto"


def _link(url, cid, user, password, **kw) -> MqttLink:
    return MqttLink(url, cid, username=user, password=password, **kw).connect(20)  # a loaded CI


@pytest.mark.parametrize("production_broker", ["one listener", "two listeners"],
                         indirect=True)
def test_logins_acl_and_no_session_takeover(production_broker) -> None:
    # "two listeners" (a device deployer helper's): uncommenting the TLS listener left the
    # plain one without use_username_as_clientid (a listener option), and one login could
    # take another's session over (the test runs on the plain listener)
    url, pw, _ = production_broker
    with pytest.raises(BrokerUnavailable):
        _link(url, "dev1", "dev1", "wrong")
    got: list[tuple[str, bytes]] = []
    cond = threading.Condition()

    def inbox(topic, payload):
        with cond:
            got.append((topic, payload))
            cond.notify_all()

    agg = _link(url, "aggregator", "aggregator", pw["aggregator"])
    agg.subscribe(T.updates, inbox)
    dev1 = _link(url, "dev1", "dev1", pw["dev1"])
    drops = []
    dev1._client.on_disconnect = lambda *a: drops.append(a)
    # dev2 tries to take over dev1's session with dev1's client id: the broker uses dev2's
    # username as its client id instead, so dev1 stays connected
    dev2 = _link(url, "dev1", "dev2", pw["dev2"])
    dev2.publish(T.update("dev1"), b"spoofed", wait=True)  # refused by the ACL
    dev2.publish(T.global_, b"forged global", wait=True)  # refused by the ACL
    dev2.publish(T.update("dev2"), b"own", wait=True)
    dev1.publish(T.update("dev1"), b"dev1 own", wait=True)
    with cond:
        cond.wait_for(lambda: len(got) >= 2, 5)
    assert sorted(got) == [(T.update("dev1"), b"dev1 own"), (T.update("dev2"), b"own")]
    assert drops == [] and dev1.is_connected
    for link in (dev1, dev2, agg):
        link.close()


class _Inbox:
    """Messages a link received, with a wait for a condition on them."""

    def __init__(self) -> None:
        self.got: list[tuple[str, bytes]] = []
        self.cond = threading.Condition()

    def __call__(self, topic: str, payload: bytes) -> None:
        with self.cond:
            self.got.append((topic, payload))
            self.cond.notify_all()

    def wait(self, pred, timeout: float = 5) -> bool:
        with self.cond:
            return self.cond.wait_for(pred, timeout)


def test_a_device_that_restarts_keeps_its_queued_stream(production_broker) -> None:
    # a deployer helper's report: `edgefcl client` first reads the fleet's config over a
    # short clean-session connection; the shipped broker takes the username as the client
    # id, so that connection ended the device's own session and its queued mini-batches
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    from edgefcl.config import RunConfig, apply
    from edgefcl.runtime.join import preflight

    url, pw, _ = production_broker
    got = _Inbox()

    def session() -> paho.Client:
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id="dev1", clean_session=False)
        c.username_pw_set("dev1", pw["dev1"])
        c.on_message = lambda cl, u, m: got(m.topic, m.payload)
        c.connect("127.0.0.1", int(url.rsplit(":", 1)[1]))
        c.loop_start()
        return c

    c = session()
    c.subscribe(T.stream("dev1"), 1)
    time.sleep(0.5)
    c.disconnect()
    c.loop_stop()
    rep = _link(url, "replayer", "replayer", pw["replayer"])
    for i in range(3):
        rep.publish(T.stream("dev1"), b"batch %d" % i, qos=1, wait=True)
    cfg = apply(RunConfig(), {"mqtt": {"broker": url, "fleet": FLEET, "username": "dev1",
                                       "password": pw["dev1"]}})
    assert preflight(cfg, "dev1", {}, timeout=0.5) is None  # no aggregator: no config
    c = session()
    assert got.wait(lambda: len(got.got) == 3, 5), got.got
    assert [p for _, p in got.got] == [b"batch 0", b"batch 1", b"batch 2"]
    c.disconnect()
    c.loop_stop()
    rep.close()


def test_control_is_refused_from_a_device_and_taken_from_the_operator(production_broker):
    """The daemon cannot tell who sent a message on `control`; the broker's ACL makes sure only
    the operator (and the aggregator itself) can publish there."""
    url, pw, _ = production_broker
    inbox = _Inbox()
    agg = _link(url, "aggregator", "aggregator", pw["aggregator"])
    agg.subscribe(T.control, inbox)
    stop = encode(Message("control", {"command": "stop"}, sender="x"), fleet=FLEET)
    dev1 = _link(url, "dev1", "dev1", pw["dev1"])
    dev1.publish(T.control, stop, wait=True)  # refused by the ACL
    dev1.publish(T.control, stop, retain=True, wait=True)
    op = _link(url, "operator", "operator", pw["operator"])
    op.publish(T.control, b"operator", wait=True)
    assert inbox.wait(lambda: inbox.got, 5)
    assert not inbox.wait(lambda: len(inbox.got) > 1, 1)
    assert inbox.got == [(T.control, b"operator")]
    for link in (dev1, op, agg):
        link.close()


def test_the_replayer_reads_statuses_and_writes_only_streams(production_broker):
    """`edgefcl replay` starts a device's stream once the device says it is online, and stops
    when the aggregator or a device refused: under the shipped ACL it must read both statuses
    (it read none, and waited its 120 s for devices that were online), and write only the
    streams."""
    url, pw, _ = production_broker
    inbox = _Inbox()
    rep = _link(url, "replayer", "replayer", pw["replayer"])
    rep.subscribe(T.status("dev1"), inbox)
    rep.subscribe(T.aggregator_status, inbox)
    dev1 = _link(url, "dev1", "dev1", pw["dev1"])
    agg = _link(url, "aggregator", "aggregator", pw["aggregator"])
    dev1.publish(T.status("dev1"), b"online", retain=True, wait=True)
    agg.publish(T.aggregator_status, b"refused", retain=True, wait=True)
    assert inbox.wait(lambda: len(inbox.got) >= 2, 5), inbox.got
    assert sorted(inbox.got) == sorted([(T.status("dev1"), b"online"),
                                        (T.aggregator_status, b"refused")])
    seen = _Inbox()
    agg.subscribe(T.status("dev1"), seen)
    agg.subscribe(T.global_, seen)
    rep.publish(T.status("dev1"), b"forged", wait=True)  # refused by the ACL
    rep.publish(T.global_, b"forged global", wait=True)  # refused by the ACL
    assert seen.wait(lambda: seen.got, 5)  # dev1's retained status
    assert not seen.wait(lambda: any(p.startswith(b"forged") for _, p in seen.got), 1)
    for link in (rep, dev1, agg):
        link.close()


ROUND_TIMEOUT = 5.0


def _bomb(cid: str) -> bytes:
    inner: dict = {"state": "online"}
    for _ in range(500):
        inner = {"x": inner}
    return msgpack.packb({"schema": 1, "kind": "status", "fleet": FLEET, "sender": cid,
                          "x": inner})


def _start_aggregator(url: str, pw: dict, tmp: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "edgefcl", "aggregator", "--broker", url, "--fleet", FLEET,
           "--username", "aggregator", "--initial", str(tmp / "init.npz"),
           "--state-dir", str(tmp / "state"), "--mode", "async", "--clients", "2",
           "--min-clients", "2", "--round-timeout", str(ROUND_TIMEOUT), "--burn-in", "0",
           "--jump", "1"]
    env = {**os.environ, "EDGEFCL_MQTT_PASSWORD": pw["aggregator"],
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "aggregator.log", "ab"))  # noqa: SIM115


@pytest.mark.slow
def test_retained_attacks_survive_aggregator_restarts(production_broker, tmp_path) -> None:
    """A nested-map bomb and a `stop` published retained on devices' own status and update
    topics reach every restarted `edgefcl aggregator` again: each restart survives them, counts
    each under its own reason, and still aggregates the honest devices' updates at once (well
    within one round timeout). Restarts: SIGTERM, SIGKILL, then the operator's stop."""
    from edgefcl.federation.messages import GlobalModel, Update
    from edgefcl.support.statefiles import save_tensors
    from edgefcl.transport.codec import decode

    url, pw, _ = production_broker
    shapes = {"w": (8, 8), "b": (8,)}
    save_tensors(tmp_path / "init.npz", {k: np.zeros(s, np.float32) for k, s in shapes.items()})
    links = {u: _link(url, u, u, pw[u]) for u in ("operator", "dev1", "dev2", "dev3", "dev4")}
    stop = {c: encode(Message("control", {"command": "stop"}, sender=c), fleet=FLEET)
            for c in ("dev1", "dev4")}
    attacks = [("dev1", T.status("dev1"), _bomb("dev1")), ("dev1", T.update("dev1"), stop["dev1"]),
               ("dev4", T.status("dev4"), stop["dev4"]), ("dev4", T.update("dev4"), _bomb("dev4"))]
    for cid, topic, payload in attacks:
        links[cid].publish(topic, payload, retain=True, wait=True)
    for cid in ("dev2", "dev3"):
        online = encode(Message("status", {"state": "online", "incarnation": f"{cid}-1"},
                                sender=cid), fleet=FLEET)
        links[cid].publish(T.status(cid), online, retain=True, wait=True)
    watch = _Inbox()
    links["dev2"].subscribe(T.global_, watch)
    links["dev2"].subscribe(T.aggregator_status, watch)

    def latest(topic: str):
        with watch.cond:
            payloads = [p for t, p in watch.got if t == topic]
        return decode(payloads[-1], FLEET) if payloads else None

    def counters_reach(n: int):
        s = latest(T.aggregator_status)
        c = s.body.get("counters", {}) if s is not None and s.body["state"] == "online" else {}
        return c.get("rejected_limits", 0) >= n and c.get("rejected_kind", 0) >= n

    rng = np.random.default_rng(0)
    for k, how in enumerate(("sigterm", "sigkill", "operator stop"), start=1):
        proc = _start_aggregator(url, pw, tmp_path)
        try:
            assert watch.wait(lambda k=k: counters_reach(2 * k), 90), (
                tmp_path / "aggregator.log").read_text()[-3000:]
            assert proc.poll() is None  # neither the bomb nor the stop ended it
            counters = latest(T.aggregator_status).body["counters"]
            # one per retained attack per start: two bombs (limits), two stops (kind)
            assert counters["rejected_limits"] == 2 * k and counters["rejected_kind"] == 2 * k
            assert counters.get("rejected_internal", 0) == 0
            version = latest(T.global_).version
            t0 = time.monotonic()
            for cid in ("dev2", "dev3"):
                tensors = {n: rng.normal(0, 0.1, s).astype(np.float32) for n, s in shapes.items()}
                links[cid].publish(T.update(cid), encode(
                    Update(cid, version, k, 0, k, 8, tensors, class_counts={0: 8}),
                    fleet=FLEET), wait=True)
            assert watch.wait(lambda v=version: latest(T.global_).version == v + 1,
                              ROUND_TIMEOUT), "the honest updates were not aggregated"
            took = time.monotonic() - t0
            g = latest(T.global_)
            assert isinstance(g, GlobalModel) and g.participants == ("dev2", "dev3")
            assert took < ROUND_TIMEOUT and proc.poll() is None
            if how == "sigterm":
                proc.send_signal(signal.SIGTERM)
            elif how == "sigkill":
                proc.send_signal(signal.SIGKILL)
            else:
                links["operator"].publish(T.control, encode(
                    Message("control", {"command": "stop"}, sender="operator"), fleet=FLEET),
                    wait=True)
            code = proc.wait(30)
            assert code == (-signal.SIGKILL if how == "sigkill" else 0)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for link in links.values():
        link.close()


@pytest.mark.slow
def test_bench_flood_reports_memory_and_keeps_the_aggregator_alive(tmp_path) -> None:
    """`edgefcl bench flood` on a small flood: the aggregator process survives both floods,
    rejects the tensor-count updates (larger than the payload limit sized from its model, so
    at their first chunk) and stays far below 256 MiB."""
    if not (shutil.which("mosquitto") or Path("/usr/sbin/mosquitto").exists()):
        pytest.skip("mosquitto is not installed")
    from edgefcl.bench.flood import bench_flood
    from edgefcl.config import RunConfig

    r = bench_flood(RunConfig(), tmp_path, 50)
    assert all(p["aggregator_alive"] for p in r["phases"].values())
    assert r["phases"]["chunk flood"]["offered_mib"] >= 50
    assert r["max_payload"] < 8 << 20  # sized from the bench's 66k-parameter model
    assert r["counters"].get("rejected_oversized", 0) >= 2
    assert r["phases"]["settle after"]["honest_rounds"] > 0
    assert r["rss_hwm_mib"] < 256
