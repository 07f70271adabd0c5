"""The worked examples of docs/architecture.md work as written: the score file plus its one
SCORES line makes a method; the dense rule file plus its one DENSE_RULES line makes an
aggregation the config accepts and the aggregator runs; the q8 encoding is the real file; a
message kind's line makes a kind the codec carries and a device handles; a head's two lines
make a head the config accepts and the model builder wraps."""

from __future__ import annotations

import logging
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


def test_message_kind_example(monkeypatch: pytest.MonkeyPatch,
                              caplog: pytest.LogCaptureFixture) -> None:
    from typing import Any

    from edgefcl.runtime.device_runner import DeviceRunner
    from edgefcl.transport import codec, kinds

    ns: dict[str, Any] = {"Any": Any, "field": kinds.field, "CodecError": codec.CodecError,
                          "Kind": kinds.Kind, "Message": codec.Message,
                          "log": logging.getLogger("edgefcl.client")}
    exec(next(b for b in BLOCKS if "def _notice" in b), ns)  # noqa: S102
    kind = eval(registry_line('Kind("notice"').rstrip(","), ns)  # noqa: S307
    monkeypatch.setitem(kinds.KINDS, "notice", kind)
    monkeypatch.setattr(codec, "MAP_KINDS", codec.MAP_KINDS | {"notice"})
    assert "notice" in kinds.kinds_on("control")
    wire = codec.encode(codec.Message("notice", {"text": "rebooting at noon"}), fleet="f",
                        sender="operator")
    msg = codec.decode(wire, "f")
    assert isinstance(msg, codec.Message) and msg.body["text"] == "rebooting at noon"
    with pytest.raises(codec.CodecError) as e:
        codec.decode(codec.encode(codec.Message("notice", {"text": "x" * 201}), fleet="f",
                                  sender="operator"))
    assert e.value.reason == "limits"
    handlers = eval("{" + registry_line('"notice": "_on_notice"') + "}")  # noqa: S307
    monkeypatch.setattr(DeviceRunner, "_ON_MESSAGE", {**DeviceRunner._ON_MESSAGE, **handlers})
    exec(next(b for b in BLOCKS if "def _on_notice" in b).replace("\n    ", "\n").strip(),
         ns)  # noqa: S102
    monkeypatch.setattr(DeviceRunner, "_on_notice", ns["_on_notice"], raising=False)
    with caplog.at_level(logging.INFO, logger="edgefcl.client"):
        getattr(DeviceRunner, DeviceRunner._ON_MESSAGE["notice"])(None, msg)
    assert "rebooting at noon" in caplog.text


def test_head_example(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from edgefcl.build import prepare
    from edgefcl.federation import heads
    from edgefcl.learn import model_heads

    mod = module_from_doc("edgefcl.learn.cosine_head", "class CosineLinear")
    monkeypatch.setitem(sys.modules, "edgefcl.learn.cosine_head", mod)
    head = eval(registry_line('Head("cosine"').rstrip(","), {"Head": heads.Head})  # noqa: S307
    model_head = eval(registry_line('name="cosine"').rstrip(","), {  # noqa: S307
        "dataclasses": dataclasses, "FIXED": model_heads.FIXED, **vars(mod)})
    monkeypatch.setitem(heads.HEADS, "cosine", head)
    monkeypatch.setitem(model_heads.MODEL_HEADS, "cosine", model_head)
    cfg = apply(RunConfig(), {"quiet": True, "learn": {"head": "cosine"}})
    fixed = prepare(apply(RunConfig(), {"quiet": True}), 0).initial
    setup = prepare(cfg, 0)
    model = setup.initial
    assert model_heads.head_of(model) is model_head and not heads.library_head(cfg)
    assert model.state_dict().keys() == fixed.state_dict().keys()  # the same global tensors
    x = torch.from_numpy(setup.tasks[0][0].x_test[:5])
    logits = model(x)
    assert logits.shape == fixed(x).shape and logits.abs().max() <= mod.SCALE + 1e-4
