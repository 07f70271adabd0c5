"""The federated client: an online `StreamLearner` wrapped with the burn-in / jump schedule that
decides when it sends an update and the encoding of that update (docs/algorithms.md §1,
Algorithm 1).
Built by `edgefcl.build.new_client`, which makes and injects the collaborators."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from edgefcl.config import FedConfig, LearnConfig
from edgefcl.data.types import Batch
from edgefcl.federation.messages import GlobalModel, Tick, Update
from edgefcl.federation.schedule import eligible
from edgefcl.federation.versions import DownlinkState
from edgefcl.learn.checkpoint import (
    FORMAT,
    check_checkpoint,
    data_attrs,
    fingerprint,
    load_data_attrs,
)
from edgefcl.learn.learner import StreamLearner
from edgefcl.learn.merges import MERGES, REPLACE, MergeRule
from edgefcl.learn.objectives import MethodHooks
from edgefcl.learn.params import get_tensors, set_tensors


@dataclass(frozen=True)
class Schedule:
    """Algorithm 1's participation schedule: after `burn_in` mini-batches of a task, every
    `jump`-th one."""

    burn_in: int
    jump: int

    def due(self, batch_in_task: int) -> bool:
        """Whether the client takes part after its `batch_in_task`-th mini-batch of the task."""
        return eligible(batch_in_task, self.burn_in, self.jump)


class Client:
    """An online federated continual learner.

    `step(batch)` lets the learner learn the batch (train + memory update) and returns an
    Update when the schedule says this client takes part. `apply_global(g)` merges a new
    global model. The method hooks (`hooks`) see this object: the learner's state is read
    through the properties below.
    """

    def __init__(self, learner: StreamLearner, fed: FedConfig, encoder: Any,
                 hooks: MethodHooks) -> None:
        self.learner = learner
        self.fed = fed
        self.schedule = Schedule(fed.burn_in, fed.jump)
        self.encoder = encoder
        self.hooks = hooks
        self.version = 0
        self.seq = 0
        self.base = get_tensors(learner.model)  # state of the last global merged
        self.downlink = DownlinkState(self.base)  # turns delta globals into whole ones
        self.sent: dict[str, np.ndarray] | None = None
        self.sent_base = 0
        """The version of the global the last update sent was trained from."""
        self.in_flight: dict[int, dict[str, np.ndarray]] = {}
        """Async: the state each of the last `fed.in_flight` updates sent had (seq -> state),
        so that a global holding an older one is merged by what it holds (`apply_global`)."""
        self.pace: Callable[[], bool] | None = None
        """Asked at every due update whether to send it (None: always); a held update keeps
        its sequence number and is not encoded, unless it is the last of the stream
        (`held_update`; runtime/backpressure.py)."""
        self.held: tuple[int, int, int, dict[int, int]] | None = None
        """The last due update was held back by `pace`: the (task, batch, samples, class counts)
        it was due with."""
        learner.bind(lambda: hooks.penalty(self), lambda task: hooks.on_task_start(self, task))
        hooks.attach(self)

    # -- the learner's state, read by hooks and drivers --------------------------------------
    cid = property(lambda self: self.learner.cid)
    learn: LearnConfig = property(lambda self: self.learner.learn)  # type: ignore[assignment]
    method = property(lambda self: self.learner.learn.method)
    model: torch.nn.Module = property(lambda self: self.learner.model)  # type: ignore[assignment]
    device = property(lambda self: self.learner.device)
    opt = property(lambda self: self.learner.opt)
    gen = property(lambda self: self.learner.gen)
    memory = property(lambda self: self.learner.memory)
    perturber = property(lambda self: self.learner.perturber)
    score_model = property(lambda self: self.learner.score_model)
    score_version = property(lambda self: self.learner.score_version)
    monitor = property(lambda self: self.learner.monitor)
    onnx = property(lambda self: self.learner.onnx)
    protos = property(lambda self: self.learner.protos)
    task = property(lambda self: self.learner.task)
    batch_in_task = property(lambda self: self.learner.batch_in_task)
    samples_in_task = property(lambda self: self.learner.samples_in_task)
    class_counts = property(lambda self: self.learner.class_counts)
    batches = property(lambda self: self.learner.batches)
    scored = property(lambda self: self.learner.scored)
    scored_ahead = property(lambda self: self.learner.scored_ahead)
    sample_shape = property(lambda self: self.learner.sample_shape)
    timings = property(lambda self: self.learner.timings)
    background = property(lambda self: self.learner.background)
    clock = property(lambda self: self.learner.clock)

    @property
    def skip_scoring(self) -> bool:
        """Whether the learner skips scoring (a device over its compute budget)."""
        return self.learner.skip_scoring

    @skip_scoring.setter
    def skip_scoring(self, value: bool) -> None:
        self.learner.skip_scoring = value

    @property
    def sends_likelihoods(self) -> bool:
        """Whether updates carry likelihoods (posterior / prior: the Gaussian encoder under the
        fedbnn rule, after the standard-network phase); the prototype rows follow it."""
        return bool(getattr(self.encoder, "likelihood", False))

    # -- the online step --------------------------------------------------------------------
    def step(self, batch: Batch) -> Update | None:
        """Process one mini-batch once; an Update when this client takes part now."""
        self.learner.learn_one(batch)
        return self.after_learning()

    def after_learning(self) -> Update | None:
        """The schedule's part of `step`, once the learner has learned the batch: an Update
        when this client takes part now (None when it does not, or `pace` holds it back)."""
        learner = self.learner
        if not self.schedule.due(learner.batch_in_task):
            return None
        self.seq += 1
        due = (learner.task or 0, learner.batch_in_task, learner.samples_in_task,
               dict(learner.class_counts))
        self.held = due if self.pace is not None and not self.pace() else None
        return self._update(*due) if self.held is None else None

    def held_update(self) -> Update | None:
        """The update of the last due mini-batch when backpressure held it back (once), from
        the model as it is now but named by the mini-batch it was due at (the stream may have
        gone on to one the schedule does not admit): sent at the end of a stream, so that the
        device's last mini-batches still reach the fleet. None when nothing is held, or when
        the stream has gone on into another task, whose burn-in has not passed."""
        due, self.held = self.held, None
        if due is None or due[0] != (self.learner.task or 0):
            return None
        return self._update(*due)

    def _update(self, task: int, batch: int, samples: int,
                class_counts: dict[int, int]) -> Update:
        self.sent = get_tensors(self.learner.model)
        self.sent_base = self.version
        if self.fed.mode == "async" and self.fed.in_flight > 0:
            self.in_flight[self.seq] = self.sent
            for old in sorted(self.in_flight)[:-self.fed.in_flight]:
                del self.in_flight[old]
        payload = self.encoder.encode(self.sent, self.base)
        protos = self.learner.protos
        return Update(self.cid, self.version, self.seq, task, batch, samples, payload,
                      self.encoder.name, class_counts,
                      protos.outgoing(self.sends_likelihoods) if protos is not None else None)

    def tick(self) -> Tick:
        """A lock-step report for a mini-batch at which this client is not eligible."""
        self.seq += 1
        return Tick(self.cid, self.seq, self.learner.task or 0, self.learner.batch_in_task)

    # -- persistence ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this client after a reboot (CPU copies; torch.save-able):
        the learner's state, the federation counters, the last merged global (`base`), the
        last state sent (`sent`), the downlink, encoder (error feedback) and hooks state."""
        state = {"format": FORMAT, "fingerprint": fingerprint(self.cid, self.learn, self.fed),
                 **self.learner.state_dict()}
        state["counters"] = {**state["counters"], "version": self.version, "seq": self.seq,
                             "sent_base": self.sent_base}
        state["held"] = None if self.held is None else [*self.held[:3], dict(self.held[3])]
        state["base"] = {k: np.array(v, copy=True) for k, v in self.base.items()}
        state["sent"] = None if self.sent is None else {k: np.array(v, copy=True)
                                                        for k, v in self.sent.items()}
        state["downlink"] = data_attrs(self.downlink)
        state["encoder"] = data_attrs(self.encoder)
        state["hooks"] = data_attrs(self.hooks)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()` into a client built from the same configuration."""
        check_checkpoint(state, fingerprint(self.cid, self.learn, self.fed))
        self.learner.load_state_dict(state)
        self.version = state["counters"]["version"]
        self.seq = state["counters"]["seq"]
        self.sent_base = int(state["counters"].get("sent_base", 0))
        held = state.get("held")  # absent from checkpoints of earlier versions
        self.held = None if held is None else (
            int(held[0]), int(held[1]), int(held[2]), {int(c): int(n) for c, n in held[3].items()})
        self.base = dict(state["base"])
        self.sent = state["sent"]
        dev = self.device
        load_data_attrs(self.downlink, state["downlink"], dev)
        load_data_attrs(self.encoder, state["encoder"], dev)
        load_data_attrs(self.hooks, state["hooks"], dev)

    # -- federation -----------------------------------------------------------------------
    def apply_global(self, g: GlobalModel, rule: MergeRule = REPLACE) -> None:
        """Merge a global model this client took part in, by `rule` (`learn/merges.py`):
        replace (lock-step, Algorithm 1), or an async rule that keeps the progress made since
        the update was sent. The model as it was just before the merge becomes the scoring
        snapshot. `g` may be a delta from the version this client holds (sparse downlink).

        Async: where `g` holds (`g.counted`) an older update of this client than the newest it
        sent, every rule keeps the progress made since the counted update's state (theta_g +
        s * (theta_now - theta_counted), s = 1 but for the staleness rule): replacing would
        throw away updates already on their way.
        """
        g = self.downlink.resolve(g)
        self.learner.snapshot()
        now = get_tensors(self.model)
        merged = self.encoder.decode_global(g.tensors, now)
        self.base = merged
        counted = g.counted.get(self.cid)
        since = self._in_flight_since(counted)
        keeps_local = rule.keeps_local or since is not None
        if rule is not REPLACE or since is not None:
            params = {k for k, _ in self.model.named_parameters()}
            weight = rule.local_weight(self.fed, g.version - self.sent_base)
            keeping = MERGES["delta"] if rule is REPLACE else rule
            merged = keeping.apply(merged, now, self.sent if since is None else since, params,
                                   weight)
            if counted is not None and since is not None:  # the later ones, as from the merge
                self._shift_in_flight(counted, {k: self.base[k] - since[k] for k in params})
        set_tensors(self.model, merged)
        if self.protos is not None:
            self.protos.merge(g.prototypes, keeps_local)
        self.version = g.version
        self.hooks.on_global(self, g)
        if self.onnx is not None:
            self.onnx.on_global(self.learner)

    def _in_flight_since(self, counted: int | None) -> dict[str, np.ndarray] | None:
        """The state of the update `counted` when a newer one was sent since (else None).
        The kept states are dropped when the merge will not move them with the model: `g`
        holds the newest update, none of this client's (a catch-up, or the gate's global not
        listing it), or one no longer kept."""
        if counted is not None and counted in self.in_flight and counted < max(self.in_flight):
            return self.in_flight[counted]
        self.in_flight.clear()
        return None

    def _shift_in_flight(self, counted: int, shift: dict[str, np.ndarray]) -> None:
        """Forget the updates up to `counted`; move the later ones by `shift` (global minus
        the counted state), so that a later global holding one of them merges the same way."""
        self.in_flight = {s: {k: v + shift[k] if k in shift else v for k, v in state.items()}
                          for s, state in self.in_flight.items() if s > counted}
        self.sent = self.in_flight.get(max(self.in_flight), self.sent)

    # -- evaluation -----------------------------------------------------------------------
    def evaluate(self, x: np.ndarray, y: np.ndarray, batch_size: int = 1024) -> float:
        """Accuracy (fraction) of the current model on (x, y), in eval mode."""
        return self.learner.evaluate(x, y, batch_size)
