"""Checkpoint helpers for an online Client, so a device resumes exactly where it stopped.

`Client.state_dict()` (learn/client.py) and `StreamLearner.state_dict()` (learn/learner.py) list
their state explicitly; this module holds the format, the configuration fingerprint and the
helpers for their parts. A checkpoint holds everything the next mini-batch depends on:
- the model (state_dict, plus the plain-data attributes of every submodule that are not
  parameters or buffers: a Bayesian layer's generator and last sample, APC's knowledge base)
  and the scoring snapshot the same way;
- the optimizer state, the client's torch generator, the replay memory (its own state_dict,
  RNG included) and the perturber's generator;
- the counters (version, seq, task, batch in task, samples in task, class counts, scored,
  batches, score version), timings, the last merged global (`base`), the last state sent (`sent`);
- the plain-data attributes (tensors, arrays, numbers, strings, containers of them, torch
  generators) of the update encoder (error-feedback residuals), the method hooks (FedProx
  anchor, Bayesian priors, APC bookkeeping), the downlink state and the ONNX helper; the
  stream monitor (prequential metric, drift detector) whole.
Objects such as modules, configs and cross references are not saved: they are rebuilt by
building the Client from the same configuration (`edgefcl.build`), then
`Client.load_state_dict` fills in the state. A checkpoint taken after batch n and restored
into a fresh Client continues bit for bit like the original client would have
(tests/test_firmware_sim.py checks several methods).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import torch

from edgefcl.config import ConfigError, FedConfig, LearnConfig

FORMAT = 1
RUNTIME_OPTIONS = ("device", "threads", "export_onnx", "score_backend", "score_process",
                   "batch_clients", "compile_step")
"""LearnConfig fields a device may change between boots without invalidating its state."""
_GENERATOR = "__torch_generator_state__"
_ATOMS = (type(None), bool, int, float, str, bytes, np.ndarray, np.generic, torch.Tensor)


def _is_data(v: Any) -> bool:
    """Plain data: atoms, torch generators and containers of them (no modules, no objects)."""
    if isinstance(v, (*_ATOMS, torch.Generator)):
        return True
    if isinstance(v, (list, tuple, set, frozenset)):
        return all(_is_data(x) for x in v)
    if isinstance(v, dict):
        return all(_is_data(k) and _is_data(x) for k, x in v.items())
    return False


def _freeze(v: Any) -> Any:
    """A detached copy of plain data; torch generators become their state."""
    if isinstance(v, torch.Generator):
        return {_GENERATOR: v.get_state()}
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", copy=True)
    if isinstance(v, dict):
        return {k: _freeze(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return type(v)(_freeze(x) for x in v)
    return copy.deepcopy(v)


def _thaw(saved: Any, current: Any, device: torch.device) -> Any:
    """Saved plain data back as live values (generator states go into the live generator)."""
    if isinstance(saved, dict) and set(saved) == {_GENERATOR}:
        if isinstance(current, torch.Generator):
            current.set_state(saved[_GENERATOR])
            return current
        return torch.Generator().set_state(saved[_GENERATOR])
    if isinstance(saved, torch.Tensor):
        dev = current.device if isinstance(current, torch.Tensor) else device
        return saved.to(dev)
    if isinstance(saved, dict):
        cur = current if isinstance(current, dict) else {}
        return {k: _thaw(x, cur.get(k), device) for k, x in saved.items()}
    if isinstance(saved, (list, tuple, set, frozenset)):
        return type(saved)(_thaw(x, None, device) for x in saved)
    return copy.deepcopy(saved)


def data_attrs(obj: Any, public_only: bool = False) -> dict[str, Any]:
    """The plain-data attributes of `obj` (see the module docstring), frozen."""
    if obj is None:
        return {}
    items = vars(obj).items()
    return {k: _freeze(v) for k, v in items
            if _is_data(v) and not (public_only and (k.startswith("_") or k == "training"))}


def load_data_attrs(obj: Any, saved: dict[str, Any], device: torch.device) -> None:
    """Set the attributes saved by `data_attrs` back on `obj`."""
    if obj is None:
        return
    for k, v in saved.items():
        setattr(obj, k, _thaw(v, getattr(obj, k, None), device))


def module_state(model: torch.nn.Module) -> dict[str, Any]:
    """A module's state_dict (CPU copies) plus its submodules' plain-data attributes."""
    extras = {name: data_attrs(m, public_only=True) for name, m in model.named_modules()}
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return {"state": state, "extras": {k: v for k, v in extras.items() if v}}


def load_module_state(model: torch.nn.Module, saved: dict[str, Any],
                       device: torch.device) -> None:
    """Restore a `module_state` into `model` (same architecture)."""
    model.load_state_dict(saved["state"])
    modules = dict(model.named_modules())
    for name, attrs in saved["extras"].items():
        if name not in modules:
            raise ConfigError(f"checkpoint has state for submodule {name!r}, which this model "
                              "lacks; was it written with another model configuration?")
        load_data_attrs(modules[name], attrs, device)


def fingerprint(cid: str, learn: LearnConfig, fed: FedConfig) -> dict[str, Any]:
    """What a checkpoint must have been written with to be restored: the client id, the
    learning configuration (less the runtime options) and the encoding and aggregation."""
    kept = {k: v for k, v in dataclasses.asdict(learn).items() if k not in RUNTIME_OPTIONS}
    return {"cid": cid, "learn": kept, "encoding": fed.encoding,
            "aggregation": fed.aggregation}


def check_checkpoint(state: Any, mine: dict[str, Any]) -> None:
    """ConfigError unless `state` is a checkpoint of this format written with the
    configuration `mine` (a `fingerprint`)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"not a client checkpoint of format {FORMAT}")
    saved = state["fingerprint"]
    if saved["cid"] != mine["cid"]:
        raise ConfigError(f"checkpoint belongs to client {saved['cid']!r}, not {mine['cid']!r}")
    diff = sorted(k for k in set(mine["learn"]) | set(saved["learn"])
                  if mine["learn"].get(k) != saved["learn"].get(k))
    diff += [k for k in ("encoding", "aggregation") if mine[k] != saved[k]]
    if diff:
        what = ", ".join(f"{k} {saved['learn'].get(k, saved.get(k))!r} -> "
                         f"{mine['learn'].get(k, mine.get(k))!r}" for k in diff)
        raise ConfigError(f"checkpoint of {mine['cid']} was written with another configuration "
                          f"({what}); restore that configuration or delete the state file")
