"""Site aggregators over Mosquitto bridges (slow): two sites, each with its own Mosquitto
bridged to a central one (broker/bridge.conf.example), a site aggregator per site and the
root on the central broker; the global equals one aggregator's over all devices."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from edgefcl.federation.aggregator import Aggregator
from edgefcl.runtime.links import topics
from edgefcl.runtime.shard_root import RootDaemon
from edgefcl.runtime.shard_worker import WorkerDaemon
from edgefcl.transport.broker import render_bridge, start_mosquitto
from edgefcl.transport.codec import encode
from edgefcl.transport.mqtt import MqttLink
from tests.runtime.test_shard_mqtt import FLEET, INITIAL, Watcher, cfg_for, device_updates


@pytest.mark.slow
@pytest.mark.parametrize("encoding,aggregation", [("dense", "class-weighted")])
def test_two_sites_and_a_root_over_bridges(mosquitto, mosquitto_exe, tmp_path, encoding,
                                           aggregation):
    central = mosquitto
    port = central.rsplit(":", 1)[1]
    sites = {s: start_mosquitto(config_dir=tmp_path / s, allow_anonymous=True,
                                binary=mosquitto_exe,
                                extra_conf="\n" + render_bridge(FLEET, s, f"127.0.0.1:{port}"))
             for s in ("site-a", "site-b")}
    daemons, threads = [], []
    try:
        cfg = cfg_for(central, encoding=encoding, aggregation=aggregation)
        root = RootDaemon(cfg, INITIAL, tmp_path / "state",
                          workers=frozenset(sites))
        daemons.append(root)
        watcher = Watcher(central)
        threads.append(threading.Thread(target=root.run, daemon=True))
        threads[-1].start()
        watcher.wait(0)
        for s, broker in sites.items():  # the retained global reaches the site over its bridge
            site_cfg = cfg_for(broker.url, encoding=encoding, aggregation=aggregation)
            daemons.append(WorkerDaemon(site_cfg, s, share_group="", flush_every=1.0))
            threads.append(threading.Thread(target=daemons[-1].run, daemon=True))
            threads[-1].start()
        deadline = time.monotonic() + 30
        while root.agg.live_workers != set(sites) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert root.agg.live_workers == set(sites)
        updates = device_updates(encoding, np.random.default_rng(5))
        links = {s: MqttLink(b.url, f"devices-{s}", clean_start=True).connect()
                 for s, b in sites.items()}
        t = topics(cfg.mqtt)
        for i, u in enumerate(updates):  # half of the devices at each site
            links["site-a" if i % 2 else "site-b"].publish(t.update(u.client),
                                                           encode(u, fleet=FLEET), wait=True)
        got = watcher.wait(1, 30)
        single = Aggregator(INITIAL, cfg.fed, batch_size=cfg.data.batch_size)
        closed = None
        for u in updates:
            closed = single.submit(u, 0.0) or closed
        assert got.participants == closed.participants
        for k, v in closed.global_.tensors.items():
            np.testing.assert_allclose(got.tensors[k], v, rtol=1e-6, atol=1e-7)
        assert [d.partials_sent for d in daemons[1:]] == [1, 1]
        for link in links.values():
            link.close()
        watcher.link.close()
    finally:
        for d in daemons:
            d.stop_event.set()
        for th in threads:
            th.join(10)
        for b in sites.values():
            b.stop()
