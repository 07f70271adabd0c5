"""The device-wait profile of `edgefcl bench client`."""

from __future__ import annotations

import torch

from edgefcl.bench.device_waits import counting, device_waits
from edgefcl.config import RunConfig, apply


def test_counts_reads_of_device_values_not_draws_from_a_cpu_generator():
    t = torch.arange(4.0)
    with counting() as sites:
        assert bool(t.sum() > 1)  # a value read
        torch.nonzero(t)  # a size that depends on values
        t.numpy()
        int(torch.randint(0, 9, (1,), generator=torch.Generator().manual_seed(0)))  # host
        t + 1  # nothing read
    assert sorted(k.split()[0] for k in sites) == ["_local_scalar_dense", "nonzero", "numpy"]
    assert sum(sites.values()) == 3 and torch.Tensor.numpy.__name__ == "numpy"


def test_a_client_mini_batch_reads_back_about_one_value():
    # 20.7 a mini-batch for BI on the demo before the memory kept its bookkeeping on the
    # host and an update came to the host in one copy
    cfg = apply(RunConfig(), {"quiet": True, "data": {"tasks": 2}})
    row = device_waits(cfg, "bi", batches=30)
    assert row["batches"] == 30 and row["per_batch"] < 3, row["sites"]
    assert all(" learn/" in site for site in row["sites"]), row["sites"]
