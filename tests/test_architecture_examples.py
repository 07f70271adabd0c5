"""The worked examples of docs/architecture.md work as written: the score file plus its one
SCORES line makes a method; the dense rule file plus its one DENSE_RULES line makes an
aggregation the config accepts and the aggregator runs."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from edgefcl.config import NAMES, FedConfig, RunConfig, apply
from edgefcl.federation.aggregator import Aggregator
from edgefcl.federation.messages import Update
from edgefcl.federation.rules import DENSE_RULES
from edgefcl.learn import methods
from edgefcl.learn.scoring.scores import uncertainty

DOC = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", DOC, flags=re.S)


def module_from_doc(name: str, marker: str) -> types.ModuleType:
    """The first python block of the page containing `marker`, as module `name`."""
    code = next(b for b in BLOCKS if marker in b)
    mod = types.ModuleType(name)
    exec(compile(code, f"docs/architecture.md:{name}", "exec"), mod.__dict__)  # noqa: S102
    return mod


def registry_line(marker: str) -> str:
    return next(b for b in BLOCKS if marker in b and len(b.strip().splitlines()) == 1).strip()


def test_score_example(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = module_from_doc("edgefcl.learn.score_pv", "def predicted_class_variance")
    monkeypatch.setitem(sys.modules, "edgefcl.learn.score_pv", mod)
    score = eval(registry_line('Score("pv"').rstrip(","), {"Score": methods.Score})  # noqa: S307
    monkeypatch.setitem(methods.SCORES, "pv", score)
    # METHODS is built from SCORES when the module loads; here, after the fact:
    both = {**methods.scored_methods(methods.SCORES), **methods.METHODS}
    monkeypatch.setattr(methods, "METHODS", both)
    monkeypatch.setitem(NAMES, "methods", both)  # what configs check names against
    cfg = apply(RunConfig(), {"learn": {"method": "pv"}})
    assert cfg.learn.method == "pv"
    z = torch.randn(4, 6, 3)
    u = uncertainty("pv", z)
    assert u.shape == (6,) and (u >= 0).all()
    assert uncertainty("pv", z[:1].repeat(4, 1, 1)).abs().max() < 1e-7  # views agree: 0


def test_dense_rule_example(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = module_from_doc("edgefcl.federation.robust.mean_around_median", "MeanAroundMedian")
    key, value = registry_line('"mean-around-median"').rstrip(",").split(": ")
    monkeypatch.setitem(DENSE_RULES, key.strip('"'), getattr(mod, value))
    fed = FedConfig(clients=3, min_clients=3, aggregation="mean-around-median", mix=1.0,
                    burn_in=0, jump=1, clip_factor=0, max_share=1)
    assert apply(RunConfig(), {"fed": {"aggregation": "mean-around-median"}})
    agg = Aggregator({"w": np.zeros(2, np.float32)}, fed)
    closed = None
    for c, v in zip("abc", (1.0, 1.2, 100.0), strict=True):
        closed = agg.submit(Update(c, 0, 1, 0, 1, 10, {"w": np.full(2, v, np.float32)}))
    assert closed is not None and closed.global_ is not None
    np.testing.assert_allclose(closed.global_.tensors["w"], [1.1, 1.1], rtol=1e-6)


def test_encoding_example_is_the_real_q8_file() -> None:
    source = (Path(__file__).resolve().parent.parent / "edgefcl" / "federation" / "q8.py")
    code = source.read_text()
    assert code[code.index("from __future__"):] in BLOCKS
