"""Golden results: the final global model's sha256 for one small run of every method, encoding
and aggregation rule. A change that moves any of them changes what a run learns: deliberate
changes regenerate the file (`EDGEFCL_REGOLD=1 pytest tests/test_golden.py`) and say why in the
commit; refactors keep them identical. Values are kept per platform (torch version and CPU
instruction set: AVX2, AVX-512 and AVX-512 with AMX kernels round differently); a platform
without values skips."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from edgefcl.config import RunConfig, apply
from edgefcl.sim.runs import simulate

GOLDEN = Path(__file__).parent / "data" / "golden_sha256.json"

SMALL = {"data": {"dataset": "digits", "tasks": 2, "batch_size": 10},
         "learn": {"memory_size": 20, "local_epochs": 1},
         "fed": {"clients": 2, "burn_in": 2, "jump": 2}}

# name -> overrides on SMALL; together they cover every method, encoding and aggregation rule
CASES: dict[str, dict] = {
    **{m: {"learn": {"method": m}} for m in
       ("bi", "lc", "ms", "rc", "en", "ag", "er", "cbr", "fedavg", "fedprox")},
    "bi-top": {"learn": {"selection": "top"}},
    "bi-step": {"learn": {"selection": "step"}},
    "bi-bottom-paper": {"learn": {"selection": "bottom", "rescore": "on_change"}},
    **{f"bi-{r}": {"learn": {"selection": r}} for r in ("mix", "kcenter", "herding")},
    "bi-rank-past": {"learn": {"rank_past": True}},
    "bi-rescore-always": {"learn": {"rescore": "always"}},
    "bi-class-weighted": {"fed": {"aggregation": "class-weighted"}},
    "bi-median": {"fed": {"aggregation": "median"}},
    "bi-trimmed-mean": {"fed": {"aggregation": "trimmed-mean", "clients": 3}},
    "bi-sparse": {"fed": {"encoding": "sparse", "topk": 0.1}},
    "bi-sparse-f16": {"fed": {"encoding": "sparse", "topk": 0.1, "value_dtype": "float16"}},
    "bi-q8": {"fed": {"encoding": "q8"}},
    "bi-gaussian-conflation": {"fed": {"encoding": "gaussian", "aggregation": "conflation"}},
    "bi-gaussian-moments": {"fed": {"encoding": "gaussian", "aggregation": "moments"}},
    "vfcl": {"learn": {"method": "vfcl"}},
    "fedbnn": {"learn": {"method": "fedbnn"}},
    "fedbnn-init": {"learn": {"method": "fedbnn"}, "fed": {"bnn_init_rounds": 1}},
    # fedbnn defaults to the prototype library (head auto); its fixed head keeps its old value
    "fedbnn-fixed-head": {"learn": {"method": "fedbnn", "head": "fixed"}},
    "fedbnn-init-fixed-head": {"learn": {"method": "fedbnn", "head": "fixed"},
                               "fed": {"bnn_init_rounds": 1}},
    "bi-prototypes": {"learn": {"head": "prototypes"}},
    "apc": {"learn": {"method": "apc"}},
    "bi-task-free": {"learn": {"task_free": True}},
    "bi-mlp-mnist1d": {"data": {"dataset": "mnist1d"}, "learn": {"model": "mlp", "hidden": 32}},
}


def _config(overrides: dict) -> RunConfig:
    values = {k: dict(v) for k, v in SMALL.items()}
    for section, table in overrides.items():
        values.setdefault(section, {}).update(table)
    return apply(RunConfig(), values)


def platform() -> str:
    """Bit-exact results hold per platform: torch's CPU kernels differ by instruction set,
    and on AVX-512 also with AMX (oneDNN and MKL dispatch on it: the same tree gives other
    hashes on an AVX-512 machine with AMX than on one without), with AVX-512 FP16 where AMX
    is not visible (an Intel machine whose AMX a VM hides gives other hashes than an AMD
    AVX-512 one), and by vendor where neither shows (MKL picks its kernels by vendor too: an
    Intel AVX-512 machine without FP16, an Ice Lake, gives other hashes than the AMD one)."""
    import torch

    flags = _cpu_flags()
    amx = " AMX" if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)() else ""
    fp16 = " FP16" if not amx and "avx512_fp16" in flags else ""
    cap = torch.backends.cpu.get_cpu_capability()
    intel = " Intel" if cap == "AVX512" and not (amx or fp16) and _vendor() == "GenuineIntel" \
        else ""
    return f"torch {torch.__version__} {cap}{amx}{fp16}{intel}"


def _vendor() -> str:
    """The CPU's vendor id as Linux lists it (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((ln for ln in text.splitlines() if ln.startswith("vendor_id")), "")
    return line.partition(":")[2].strip()


def _cpu_flags() -> set[str]:
    """The CPU's flags as Linux lists them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _all() -> dict[str, dict[str, str]]:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


def _golden() -> dict[str, str]:
    return _all().get(platform(), {})


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_global_sha256_unchanged(name: str, one_thread) -> None:
    sha = simulate(_config(CASES[name]), seed=0).global_sha256
    if os.environ.get("EDGEFCL_REGOLD"):
        everything = _all()
        everything.setdefault(platform(), {})[name] = sha
        GOLDEN.write_text(json.dumps(everything, indent=1, sort_keys=True) + "\n")
        return
    if not _golden():
        pytest.skip(f"no golden values for {platform()}: record them from main with "
                    "EDGEFCL_REGOLD=1 before a refactor")
    if name not in _golden():  # a deliberate change re-recorded on another platform only
        pytest.skip(f"no golden value for {name} on {platform()}: record it with "
                    "EDGEFCL_REGOLD=1 from the commit that last changed it")
    assert sha == _golden()[name]
