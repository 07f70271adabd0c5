"""A host process for one or more simulated devices.

Each device runs on its own thread with its own radio (TCP proxy), MqttLink, Client and flash
directory: the real DeviceRunner / Client code, several devices per process to keep a fleet
light on a small machine (`use_cpu_threads` sets torch's and BLAS's threads for the whole
process). Killing the process (`kill -9`) crashes all of its devices at an arbitrary point; a
reboot from the profile or the `reboot` command crashes one device at its next step (see
device.Firmware).

Commands on stdin (one per line), used by the fleet launcher to inject faults:
    cut <device> <seconds>     force the device's link down
    reboot <device>            crash the device; it boots again from flash
"""

from __future__ import annotations

import dataclasses
import logging
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from edgefcl.build import Setup, make_client, prepare, use_cpu_threads
from edgefcl.config import RunConfig
from edgefcl.data.workload import client_id
from edgefcl.transport.mqtt import TransportError
from firmware_sim.device import Crash, Firmware
from firmware_sim.flash import Flash
from firmware_sim.profile import DeviceProfile, ProfileError, check_memory_budget
from firmware_sim.radio import Radio, RadioLoop

log = logging.getLogger("firmware_sim.host")

RETRY_BOOT_S = 1.0
CONNECT_TIMEOUT_S = 30.0
_SKEW: dict[int, float] = {}
"""Thread id -> clock skew of the device that thread runs (for log timestamps)."""


class SkewFilter(logging.Filter):
    """Shifts the timestamps of records logged by a device thread by that device's skew."""

    def filter(self, record: logging.LogRecord) -> bool:
        skew = _SKEW.get(record.thread or 0, 0.0)
        if skew:
            record.created += skew
            record.msecs = (record.created - int(record.created)) * 1000
        return True


@dataclass
class DeviceSpec:
    """Which share of the data a device gets, its profile and its clock skew."""

    index: int
    profile: DeviceProfile
    skew_s: float = 0.0

    @property
    def cid(self) -> str:
        return client_id(self.index)


class DeviceSupervisor:
    """Boots one device again and again (after crashes) until its stream is done."""

    def __init__(self, cfg: RunConfig, setup: Setup, spec: DeviceSpec, state_root: Path,
                 results: Path | None, loop: RadioLoop) -> None:
        self.cfg = cfg
        self.setup = setup
        self.spec = spec
        self.cid = spec.cid
        self.results_dir = results
        seed = cfg.seed * 1000 + spec.index
        self.rng = random.Random(seed)
        self.radio = Radio(loop, cfg.mqtt.broker, spec.profile.link, seed=seed).start()
        # a slow link may carry a backlog of queued messages before the SUBACKs: be patient
        self.dev_cfg = dataclasses.replace(cfg, mqtt=dataclasses.replace(
            cfg.mqtt, broker=self.radio.url,
            connect_timeout=max(cfg.mqtt.connect_timeout, CONNECT_TIMEOUT_S)))
        self.flash = Flash(state_root / self.cid, spec.profile.flash.fsync)
        self.crash = threading.Event()
        self.result: dict | None = None
        self.error: BaseException | None = None
        self.crashes = 0

    def reboot(self) -> None:
        """Crash the device now (it boots again from flash)."""
        self.crash.set()

    def cut(self, seconds: float) -> None:
        self.radio.cut(seconds)

    def boot(self) -> Firmware:
        """Build the device from its profile and flash (raises ProfileError if it cannot)."""
        cfg, k = self.cfg, self.spec.index
        client = make_client(cfg, self.setup, k, cfg.learn.method, cfg.seed)
        check_memory_budget(self.spec.profile, client, self.setup.dataset.sample_shape)
        return Firmware(self.dev_cfg, client, self.spec.profile, self.flash,
                        self.setup.tasks[k], self.results_dir, self.spec.skew_s, self.crash,
                        self.radio.tx_idle)

    def run(self) -> None:
        _SKEW[threading.get_ident()] = self.spec.skew_s
        try:
            self._loop()
        except BaseException as e:  # reported by the host; never a silent thread death
            self.error = e
            log.exception("%s: failed", self.cid)
        finally:
            self.radio.close()

    def _loop(self) -> None:
        uptime = self.spec.profile.reboot.mean_uptime_s
        while True:
            self.crash.clear()
            fw = self.boot()
            timer = None
            if uptime > 0:
                timer = threading.Timer(self.rng.expovariate(1 / uptime), self.crash.set)
                timer.daemon = True
                timer.start()
            try:
                self.result = fw.run()
                return
            except Crash:
                self.crashes += 1
                self._power_off(fw)
            except TransportError as e:  # the link failed while connecting: boot again
                log.info("%s: link failed (%s); rebooting", self.cid, e)
                if fw.link is not None:
                    fw.link.close()
                time.sleep(RETRY_BOOT_S)
            finally:
                if timer is not None:
                    timer.cancel()

    def _power_off(self, fw: Firmware) -> None:
        """Lose power: the link drops uncleanly (the broker sends the last will), the MQTT
        client's queues vanish, then the device stays off for boot_s."""
        boot_s = self.spec.profile.reboot.boot_s
        log.warning("%s: crashed; booting from flash in %.1f s", self.cid, boot_s)
        self.radio.cut(boot_s + 0.2)
        if fw.link is not None:
            fw.link.close()
        time.sleep(boot_s)


def read_commands(stream: IO[str], sups: dict[str, DeviceSupervisor]) -> None:
    """Apply `cut` / `reboot` commands read line by line from `stream`."""
    for line in stream:
        parts = line.split()
        if not parts:
            continue
        try:
            cmd, cid = parts[0], parts[1]
            sup = sups[cid]
            if cmd == "cut":
                sup.cut(float(parts[2]))
            elif cmd == "reboot":
                sup.reboot()
            else:
                raise ValueError(cmd)
            log.info("command: %s", line.strip())
        except (IndexError, KeyError, ValueError):
            log.warning("ignoring bad command %r (cut <device> <s> | reboot <device>)", line)


def run_host(cfg: RunConfig, specs: list[DeviceSpec], state_root: Path,
             results: Path | None = None, commands: IO[str] | None = None) -> int:
    """Run the devices of `specs` until every one finished its stream; returns an exit code
    (0: all done, 2: a device refused its configuration, 1: another failure)."""
    use_cpu_threads(cfg.learn.threads)
    setup = prepare(cfg, cfg.seed)
    loop = RadioLoop()
    sups = {s.cid: DeviceSupervisor(cfg, setup, s, Path(state_root), results, loop)
            for s in specs}
    threads = [threading.Thread(target=s.run, name=f"device-{cid}")
               for cid, s in sups.items()]
    for t in threads:
        t.start()
    if commands is not None:
        threading.Thread(target=read_commands, args=(commands, sups), daemon=True).start()
    for t in threads:
        t.join()
    errors = {cid: s.error for cid, s in sups.items() if s.error is not None}
    for cid, e in errors.items():
        print(f"firmware_sim: {cid}: {type(e).__name__}: {e}", file=sys.stderr)
    if any(isinstance(e, ProfileError) for e in errors.values()):
        return 2
    return 1 if errors else 0
