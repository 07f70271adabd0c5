"""`edgefcl aggregator --eval-data`: the accuracy of every new global on held-out data."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from edgefcl.config import ConfigError, RunConfig
from edgefcl.data.labels import as_names
from edgefcl.federation.heads import library_head
from edgefcl.federation.messages import GlobalModel

log = logging.getLogger("edgefcl.aggregator")


class GlobalEvaluator:
    """Decodes a global as a client would and measures its accuracy on a test split (%)."""

    def __init__(self, cfg: RunConfig, setup, x: np.ndarray, y: np.ndarray) -> None:
        from edgefcl.build import make_client

        self.client = make_client(cfg, setup, 0, cfg.learn.method, cfg.seed)
        self.x, self.y = x, y

    @classmethod
    def from_config(cls, cfg: RunConfig, spec: str, setup=None) -> GlobalEvaluator:
        """`spec` is a dataset spec like --dataset ('config': the run's dataset); its test
        split (or the test split the task split carves out) is the held-out data."""
        from edgefcl.build import prepare

        setup = setup or prepare(cfg, cfg.seed)
        if spec == "config":
            ds = setup.dataset
            if ds.x_test is not None:
                x, y = ds.x_test, ds.y_test
            else:  # the split carved the test data out of each client's tasks
                x = np.concatenate([t.x_test for tasks in setup.tasks for t in tasks])
                y = np.concatenate([t.y_test for tasks in setup.tasks for t in tasks])
        else:
            from edgefcl.data.loaders import load_dataset

            ds = load_dataset(spec, cfg.data)
            if ds.x_test is None:
                raise ConfigError(f"--eval-data {spec}: the dataset has no test split")
            if ds.sample_shape != setup.dataset.sample_shape:
                raise ConfigError(f"--eval-data {spec}: samples of shape {ds.sample_shape}, "
                                  f"the fleet's model takes {setup.dataset.sample_shape}")
            x, y = ds.x_test, ds.y_test
        if library_head(cfg):
            y = as_names(y, ds.labels)  # the library is keyed by names
        log.info("evaluating every global on %d held-out samples (%s)", len(y), spec)
        return cls(dataclasses.replace(cfg), setup, x, y)

    def __call__(self, g: GlobalModel) -> float:
        """Accuracy (%) of global `g` on the held-out data."""
        from edgefcl.learn.export import global_state
        from edgefcl.learn.params import set_tensors

        set_tensors(self.client.model, global_state(self.client, g))
        return round(100.0 * float(self.client.evaluate(self.x, self.y)), 3)
