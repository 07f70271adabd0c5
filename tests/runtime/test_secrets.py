"""Attacks on the secrets: a credential, in whatever form it was given (in the broker URL, as
--password, in EDGEFCL_BROKER), must not reach a log, a status, a results or state file, and
the state must be readable by its owner alone."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from edgefcl.config import MqttConfig, RunConfig, apply, public_dict
from edgefcl.transport.mqtt import MqttLink

SMALL = ["--tasks", "2", "--classes-per-task", "2", "--clients", "2", "--memory-size", "30",
         "--local-epochs", "1", "--burn-in", "2", "--jump", "2"]


def everything_under(folder: Path) -> str:
    return "\n".join(p.read_bytes().decode("latin-1") for p in folder.rglob("*") if p.is_file())


def test_url_credentials_move_to_their_own_fields() -> None:
    m = MqttConfig(broker="mqtt://dev%40x:p%3Aw@127.0.0.1:1883")
    assert (m.broker, m.username, m.password) == ("mqtt://127.0.0.1:1883", "dev@x", "p:w")
    kept = MqttConfig(broker="mqtt://a:b@h:1", username="me", password="mine")
    assert (kept.broker, kept.username, kept.password) == ("mqtt://h:1", "me", "mine")
    cfg = apply(RunConfig(), {"mqtt": {"broker": "mqtts://u:SECRET@h:8883"}})
    assert "SECRET" not in json.dumps(public_dict(cfg)) and cfg.mqtt.password == "SECRET"
    assert "SECRET" not in MqttLink("mqtt://u:SECRET@h:1", "c").url


@pytest.mark.slow
@pytest.mark.mqtt
@pytest.mark.parametrize("form", ["url", "flag", "variable"])
def test_no_credential_reaches_a_log_status_results_or_state(form, mosquitto, tmp_path) -> None:
    secret = f"S3CRET-{form}"
    bare = mosquitto  # anonymous Mosquitto: the credentials are sent, and must stay hidden
    broker = bare.replace("mqtt://", f"mqtt://fleetuser:{secret}@")
    env = dict(os.environ)
    given = {"url": ["--broker", broker], "flag": ["--broker", bare, "--username", "fleetuser",
                                                    "--password", secret],
             "variable": []}[form]
    if form == "variable":
        env["EDGEFCL_BROKER"] = broker
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "edgefcl", "-v", "simulate", *SMALL,
                          "--transport", "mqtt", *(given or ["--broker", broker]), "--out",
                          str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert secret not in run.stdout + run.stderr
    assert secret not in everything_under(out)  # results, config.toml, fleet.toml, logs, state
    for db in out.rglob("state.db"):
        assert stat.S_IMODE(db.stat().st_mode) == 0o600
        assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
    status = subprocess.run([sys.executable, "-m", "edgefcl", "status", "--once", "--json",
                             "--wait", "0.5", *(given or [])], capture_output=True, text=True,
                            timeout=60, env=env)
    assert secret not in status.stdout + status.stderr


def test_a_workers_upstream_link_gets_none_of_the_device_brokers_credentials(
        monkeypatch) -> None:
    # the attack (a reviewer helper's): a site aggregator with --upstream
    # mqtt://s1:CENTRAL@root-broker sent the *device* broker's login (site1 / SITE_PW) to the
    # root's broker, another host, and ignored the URL's credentials; its TLS key went too
    from dataclasses import replace

    from edgefcl.runtime.links import open_link, upstream_config

    monkeypatch.setenv("EDGEFCL_MQTT_PASSWORD", "SITE_ENV_PW")
    m = MqttConfig(broker="mqtts://127.0.0.1:8883", username="site1", password="SITE_PW",
                   tls_cert="site.crt", tls_key="site.key")
    up = upstream_config(m, "mqtt://s1:CENTRAL@127.0.0.1:1884")
    assert (up.broker, up.username, up.password) == ("mqtt://127.0.0.1:1884", "s1", "CENTRAL")
    assert not (up.tls_cert or up.tls_key or up.tls_ca)  # a plain upstream: no TLS at all
    link = open_link(up, "w0-up", connect=False, password_variable=None)
    assert (link._client.username, link._client.password) == ("s1", "CENTRAL")
    tls = upstream_config(replace(m, tls_ca="ca.crt"), "mqtts://s1:CENTRAL@127.0.0.1:8884")
    assert tls.tls_ca == "ca.crt" and not (tls.tls_cert or tls.tls_key)  # the CA, not the key
    monkeypatch.setenv("EDGEFCL_UPSTREAM_PASSWORD", "CENTRAL_ENV")
    up = upstream_config(m, "mqtt://s1@127.0.0.1:1884")  # the password from its own variable
    assert (up.username, up.password) == ("s1", "CENTRAL_ENV")
    up = upstream_config(m, "mqtt://127.0.0.1:1884")  # none given: anonymous, never site1's
    link = open_link(up, "w0-up", connect=False, password_variable=None)
    assert link._client.username is None and "SITE" not in str(link._client.password)


def test_a_missing_or_broken_tls_file_is_one_line(tmp_path) -> None:
    # a device deployer's (a reviewer helper's): --tls-ca /nonexist/ca.crt ended in paho's
    # FileNotFoundError traceback
    from edgefcl.transport.transport_error import TransportError

    with pytest.raises(TransportError, match="--tls-ca /nonexist/ca.crt: no such file"):
        MqttLink("mqtts://127.0.0.1:8883", "c", tls_ca="/nonexist/ca.crt")
    junk = tmp_path / "ca.crt"
    junk.write_text("not a certificate")
    with pytest.raises(TransportError, match="TLS files"):
        MqttLink("mqtts://127.0.0.1:8883", "c", tls_ca=str(junk))
