"""The production broker set-up as shipped: broker/mosquitto.conf (only the port and the
paths changed), users made by broker/add-device.sh, the ACL from broker/acl.template."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from edgefcl.transport.broker import free_port, render_acl, wait_port
from edgefcl.transport.mqtt import BrokerUnavailable, MqttLink
from edgefcl.transport.topics import Topics

pytestmark = pytest.mark.mqtt

REPO = Path(__file__).resolve().parents[1]
FLEET = "prod"
T = Topics(FLEET)


def _production_conf(port: int, d: Path) -> str:
    conf = (REPO / "broker" / "mosquitto.conf").read_text()
    conf = conf.replace("listener 1883", f"listener {port} 127.0.0.1")
    conf = conf.replace("/etc/mosquitto/edgefcl/", f"{d}/")
    conf = conf.replace("persistence_location /var/lib/mosquitto/",
                        f"persistence_location {d}/data/")
    active = [ln for ln in conf.splitlines() if not ln.startswith("#")]
    assert sum(str(d) in ln for ln in active) == 3, "the shipped paths changed; update this test"
    return conf


@pytest.fixture
def production_broker():
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
    for user in ("aggregator", "dev1", "dev2"):
        out = subprocess.run([str(REPO / "broker" / "add-device.sh"), FLEET, user], env=env,
                             capture_output=True, text=True, check=True)
        passwords[user] = re.search(r"^password: (\S+)$", out.stdout, re.M).group(1)
    port = free_port()
    (d / "mosquitto.conf").write_text(_production_conf(port, d))
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
    return MqttLink(url, cid, username=user, password=password, **kw).connect(5)


def test_logins_acl_and_no_session_takeover(production_broker) -> None:
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
