"""Moving model parameters between torch modules and numpy tensor dicts."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from edgefcl.federation.label_rows import LabelRows, rows_digest
from edgefcl.federation.messages import Tensors


def shared_names(model: torch.nn.Module) -> list[str]:
    """Names of the floating-point state entries that are federated (params + BN statistics)."""
    return _floating(model.state_dict())


def _floating(state: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in state.items() if v.is_floating_point()]


def get_tensors(model: torch.nn.Module) -> Tensors:
    """The federated state of `model` as float32 numpy arrays (copies), in state_dict order:
    one copy to the host for all of them (on CUDA one wait, not one per tensor)."""
    state = model.state_dict()
    names = _floating(state)
    if not names:
        return {}
    # `cat` makes a new tensor: the arrays share no memory with the model
    host = torch.cat([state[k].detach().reshape(-1).to(torch.float32) for k in names]).cpu()
    host = host.numpy()
    out, at = {}, 0
    for k in names:
        n = state[k].numel()
        out[k] = host[at:at + n].reshape(state[k].shape)
        at += n
    return out


def set_tensors(model: torch.nn.Module, tensors: Tensors) -> None:
    """Load federated tensors into `model` in place (other buffers stay as they are)."""
    state = model.state_dict()
    with torch.no_grad():
        for k, v in tensors.items():
            state[k].copy_(torch.from_numpy(np.asarray(v)).to(state[k].device, state[k].dtype))


def global_sha256(tensors: Tensors, prototypes: LabelRows | None = None) -> str:
    """A global's sha256 (results' `global_sha256`): `tensors_sha256` of its tensors, and for
    a run with a prototype library the sha256 of that and the library's `rows_digest`."""
    base = tensors_sha256(tensors)
    if prototypes is None:
        return base
    return hashlib.sha256(f"{base}|{rows_digest(prototypes)}".encode()).hexdigest()


def tensors_sha256(tensors: Tensors) -> str:
    """sha256 over the tensors' names, shapes and float32 bytes, in sorted-name order."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        v = np.ascontiguousarray(tensors[k], dtype="<f4")
        h.update(k.encode())
        h.update(str(v.shape).encode())
        h.update(v.tobytes())
    return h.hexdigest()
