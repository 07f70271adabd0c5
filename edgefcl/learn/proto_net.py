"""FedBNN's prototype library (§IV-B): a shared feature extractor and a classifier whose rows
are prototypes kept in a table keyed by the label's name.

- `ProtoNet` wraps the extractor and the library; `forward` classifies among the whole library
  (prediction, scores, export). Its state_dict holds the extractor only, so every encoding
  (dense, sparse, gaussian) federates the extractor as before.
- `PrototypeLibrary` holds the rows (n, d + 1: weight and bias) and its own row-wise optimiser
  state (Adam or SGD), so a row moves only when its class was in the assembled classifier: a
  class absent from a batch receives no push at all, the paper's point.
- A label never seen gets an empty (zero) row; `warmup` trains the new rows with the extractor
  frozen before regular training.
- Gaussian rows (encoding gaussian, `sigma` given): like the Bayesian layers, every row is a
  mean row (`rows`) and a rho row (`rho`, sigma = softplus(rho), initialised from
  `--bayes-sigma`), with its own optimiser state; a sampling pass (training, posterior draws)
  uses mu + sigma * eps with eps from the extractor's generator, other passes the means. The
  prior of a row (its KL term) is the last global's row, N(0, sigma0) before one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgefcl.data.labels import MAX_LABEL_CHARS, MAX_LABELS, valid_name
from edgefcl.federation.gaussian import LIK_SIGMA_MAX, likelihood
from edgefcl.federation.label_rows import SIGMA_MIN, LabelRows
from edgefcl.federation.value_bound import MAX_VALUE
from edgefcl.learn.bayes import bayesian_layers, kl_normal, softplus_inv

HEADS = ("auto", "fixed", "prototypes")


def split_head(model: nn.Module) -> tuple[nn.Module, int]:
    """Remove the last linear layer of an edgefcl model in place; returns the extractor and
    its feature width d."""
    for owner, name in _head_slots(model):
        layer = getattr(owner, name) if not isinstance(owner, nn.Sequential) else owner[name]
        if isinstance(layer, nn.Linear):
            if isinstance(owner, nn.Sequential):
                owner[name] = nn.Identity()
            else:
                setattr(owner, name, nn.Identity())
            return model, layer.in_features
    raise ValueError(f"{type(model).__name__} has no linear head to split off")


def _head_slots(model: nn.Module) -> list[tuple[nn.Module, object]]:
    slots: list[tuple[nn.Module, object]] = []
    for attr in ("head", "linear"):
        if hasattr(model, attr):
            slots.append((model, attr))
    net = getattr(model, "net", None)
    if isinstance(net, nn.Sequential):
        slots.append((net, len(net) - 1))
    return slots


class PrototypeLibrary:
    """Label name -> classifier row, with row-wise optimiser state (see the module doc);
    Gaussian rows with `sigma` (the initial sigma of a new row)."""

    def __init__(self, dim: int, optimizer: str = "adam", lr: float = 0.01,
                 device: torch.device | str = "cpu", sigma: float | None = None) -> None:
        self.dim = dim
        self.optimizer = optimizer
        self.lr = lr
        self.device = torch.device(device)
        self.sigma0 = sigma
        self.labels: list[str] = []
        self.index: dict[str, int] = {}
        self.rows = torch.zeros(0, dim + 1, device=self.device)
        self.m = torch.zeros_like(self.rows)
        self.v = torch.zeros_like(self.rows)
        self.t = torch.zeros(0, device=self.device)
        if sigma is not None:  # Gaussian rows: rho, its Adam state and the rows' prior
            self.rho, self.mr, self.vr = (torch.zeros_like(self.rows) for _ in range(3))
            self.tr = torch.zeros(0, device=self.device)
            self.prior_mu, self.prior_sigma = torch.zeros_like(self.rows), torch.zeros_like(
                self.rows)
        self.counts: dict[str, int] = {}  # samples of each label this device trained on

    @property
    def gaussian(self) -> bool:
        return self.sigma0 is not None

    def __len__(self) -> int:
        return len(self.labels)

    def ensure(self, names: Sequence[str]) -> tuple[Tensor, int]:
        """Rows of `names` (adding empty rows for new labels) and how many were new."""
        new = [n for n in dict.fromkeys(names) if n not in self.index]
        if new:
            if len(self.labels) + len(new) > MAX_LABELS:
                raise ValueError(f"more than {MAX_LABELS} labels in the prototype library")
            bad = [n for n in new if not valid_name(n)]
            if bad:
                raise ValueError(f"label name {bad[0][:80]!r} is not 1-{MAX_LABEL_CHARS} "
                                 "printable characters")
            self._grow(new, torch.zeros(len(new), self.dim + 1, device=self.device))
        return torch.tensor([self.index[n] for n in names], device=self.device), len(new)

    def _grow(self, names: list[str], rows: Tensor) -> None:
        for n in names:
            self.index[n] = len(self.labels)
            self.labels.append(n)
        self.rows = torch.cat([self.rows, rows])
        zeros = torch.zeros_like(rows)
        self.m = torch.cat([self.m, zeros])
        self.v = torch.cat([self.v, zeros])
        self.t = torch.cat([self.t, torch.zeros(len(names), device=self.device)])
        if self.gaussian:
            sigma = torch.full_like(rows, float(self.sigma0), dtype=torch.float64)
            rho = softplus_inv(sigma).to(rows.dtype)  # as the Bayesian layers initialise
            self.rho = torch.cat([self.rho, rho])
            self.mr, self.vr = torch.cat([self.mr, zeros]), torch.cat([self.vr, zeros])
            self.tr = torch.cat([self.tr, torch.zeros(len(names), device=self.device)])
            self.prior_mu = torch.cat([self.prior_mu, zeros])
            self.prior_sigma = torch.cat([self.prior_sigma, sigma.to(rows.dtype)])

    def logits(self, features: Tensor, rows: Tensor | None = None) -> Tensor:
        """Logits of `features` against `rows` (default: the whole library's mean rows)."""
        w = self.rows if rows is None else rows
        return features @ w[:, :-1].T + w[:, -1]

    def draw(self, mu: Tensor, rho: Tensor, generator: torch.Generator | None) -> Tensor:
        """A reparameterised sample mu + softplus(rho) * eps of Gaussian rows."""
        eps = torch.randn(mu.shape, generator=generator, device=mu.device, dtype=mu.dtype)
        return mu + F.softplus(rho) * eps

    def kl(self, idx: Tensor, mu: Tensor, rho: Tensor) -> Tensor:
        """KL( N(mu, softplus(rho)^2) || the rows' prior ), summed, for rows `idx`."""
        return kl_normal(mu, F.softplus(rho), self.prior_mu[idx], self.prior_sigma[idx]).sum()

    def step(self, idx: Tensor, grad: Tensor, grad_rho: Tensor | None = None) -> None:
        """One optimiser step on rows `idx` (unique) with gradient `grad` (and, for Gaussian
        rows, `grad_rho` on their rho; None leaves rho and its state as they are)."""
        self.rows, self.m, self.v, self.t = self._step(idx, grad, self.rows, self.m, self.v,
                                                       self.t)
        if grad_rho is not None:
            self.rho, self.mr, self.vr, self.tr = self._step(idx, grad_rho, self.rho, self.mr,
                                                             self.vr, self.tr)

    def _step(self, idx: Tensor, grad: Tensor, p: Tensor, m_all: Tensor, v_all: Tensor,
              t_all: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        with torch.no_grad():
            if self.optimizer == "sgd":
                p[idx] -= self.lr * grad
                return p, m_all, v_all, t_all
            b1, b2, eps = 0.9, 0.999, 1e-8  # torch.optim.Adam's defaults
            t = t_all[idx] + 1
            t_all[idx] = t
            m = m_all[idx].mul_(b1).add_(grad, alpha=1 - b1)
            v = v_all[idx].mul_(b2).addcmul_(grad, grad, value=1 - b2)
            m_all[idx], v_all[idx] = m, v
            mhat = m / (1 - b1 ** t)[:, None]
            vhat = v / (1 - b2 ** t)[:, None]
            p[idx] -= self.lr * mhat / (vhat.sqrt() + eps)
        return p, m_all, v_all, t_all

    _GAUSSIAN_STATE = ("rho", "mr", "vr", "tr", "prior_mu", "prior_sigma")

    def subset(self, names: Sequence[str]) -> PrototypeLibrary:
        """A copy holding only `names` (rows and optimiser state), in library order."""
        out = PrototypeLibrary(self.dim, self.optimizer, self.lr, self.device, self.sigma0)
        keep = [n for n in self.labels if n in set(names)]
        idx = torch.tensor([self.index[n] for n in keep], dtype=torch.long, device=self.device)
        out._grow(keep, self.rows[idx].clone())
        out.m, out.v, out.t = self.m[idx].clone(), self.v[idx].clone(), self.t[idx].clone()
        if self.gaussian:
            for key in self._GAUSSIAN_STATE:
                setattr(out, key, getattr(self, key)[idx].clone())
        out.counts = {n: self.counts[n] for n in keep if n in self.counts}
        return out

    def count(self, names: Sequence[str], n: Sequence[int]) -> None:
        for name, k in zip(names, n, strict=True):
            self.counts[name] = self.counts.get(name, 0) + int(k)

    # -- federation ---------------------------------------------------------------------------
    def sigmas(self) -> np.ndarray:
        """The rows' sigmas, softplus(rho) in float64 as `federation.gaussian.to_wire`,
        clamped to SIGMA_MIN, float32."""
        rho = self.rho.detach().to("cpu", torch.float64).numpy()
        return np.maximum(np.logaddexp(0.0, rho), SIGMA_MIN).astype(np.float32)

    def table(self, only_counted: bool = True) -> LabelRows:
        """The rows (of the labels this device trained on, by default) as a wire table."""
        names = [n for n in self.labels if not only_counted or self.counts.get(n, 0) > 0]
        idx = [self.index[n] for n in names]
        rows = self.rows[idx].detach().to("cpu", torch.float32).numpy().copy()
        counts = np.array([self.counts.get(n, 0) for n in names], np.int64)
        sigmas = self.sigmas()[idx].reshape(len(names), self.dim + 1) if self.gaussian else None
        return LabelRows(tuple(names), rows.reshape(len(names), self.dim + 1), counts,
                         sigmas)

    def likelihood_table(self, table: LabelRows) -> LabelRows:
        """`table` (Gaussian rows of this library) as the rows' likelihoods, posterior / prior
        (FedBNN Eq. 9, the fedbnn aggregation rule): `federation.gaussian.likelihood` of each
        row against its prior (the last global's row, N(0, sigma0) for a label the global does
        not hold), as the Gaussian encoder does for the extractor's weights: entries whose
        posterior did not narrow are sent as sigma = LIK_SIGMA_MAX, m = the posterior mean,
        and so is an entry whose likelihood mean would leave the rows' bound (MAX_VALUE)."""
        idx = [self.index[n] for n in table.labels]
        prior_mu = self.prior_mu[idx].detach().to("cpu", torch.float64).numpy()
        prior_sigma = self.prior_sigma[idx].detach().to("cpu", torch.float64).numpy()
        mu_q = np.asarray(table.rows, np.float64)
        m, s, invalid = likelihood(mu_q, np.asarray(table.sigmas, np.float64),
                                   prior_mu.reshape(mu_q.shape), prior_sigma.reshape(mu_q.shape))
        wild = ~invalid & ~(np.abs(m) <= MAX_VALUE)
        m = np.where(wild, mu_q, m)
        s = np.where(wild, LIK_SIGMA_MAX, s)
        return LabelRows(table.labels, m.astype(np.float32), table.counts,
                         s.astype(np.float32))

    def merge(self, table: LabelRows, sent: LabelRows | None = None) -> None:
        """Take the global library's rows; with `sent` (async delta merge) a row this device
        sent keeps the progress made since: row = global + (now - sent) (Gaussian rows: on the
        means and on rho). The global's Gaussian rows become the rows' prior."""
        if table.width != self.dim + 1:
            raise ValueError(f"global prototypes have width {table.width}, expected "
                             f"{self.dim + 1}")
        rows = torch.from_numpy(np.asarray(table.rows, np.float32)).to(self.device)
        gaussian = self.gaussian and table.sigmas is not None
        if gaussian:
            sig = np.asarray(table.sigmas, np.float64)
            prior_sigma = torch.from_numpy(sig.astype(np.float32)).to(self.device)
            rho = softplus_inv(torch.from_numpy(sig)).to(self.device, torch.float32)
            prior_mu = rows.clone()
        if sent is not None and sent.labels:
            at = table.row_of()
            both = [n for n in sent.labels if n in at and n in self.index]
            if both:
                g = torch.tensor([at[n] for n in both], device=self.device)
                s = torch.tensor([sent.row_of()[n] for n in both], device=self.device)
                mine = torch.tensor([self.index[n] for n in both], device=self.device)
                sent_rows = torch.from_numpy(sent.rows).to(self.device)
                rows = rows.clone()
                rows[g] += self.rows[mine] - sent_rows[s]
                if gaussian and sent.sigmas is not None:
                    sent_rho = softplus_inv(torch.from_numpy(
                        np.asarray(sent.sigmas, np.float64))).to(self.device, torch.float32)
                    rho[g] += self.rho[mine] - sent_rho[s]
        idx, _ = self.ensure(list(table.labels))
        with torch.no_grad():
            self.rows[idx] = rows
            if gaussian:
                self.rho[idx] = rho
                self.prior_mu[idx], self.prior_sigma[idx] = prior_mu, prior_sigma

    # -- persistence --------------------------------------------------------------------------
    def state(self) -> dict:
        keys = ("rows", "m", "v", "t") + (self._GAUSSIAN_STATE if self.gaussian else ())
        return {"labels": list(self.labels), "counts": dict(self.counts),
                **{k: getattr(self, k).cpu().numpy().copy() for k in keys}}

    def load(self, state: dict) -> None:
        self.labels = [str(n) for n in state["labels"]]
        self.index = {n: i for i, n in enumerate(self.labels)}
        keys = ("rows", "m", "v", "t") + (self._GAUSSIAN_STATE if self.gaussian else ())
        for key in keys:
            setattr(self, key, torch.from_numpy(np.asarray(state[key], np.float32))
                    .to(self.device))
        self.counts = {str(k): int(v) for k, v in state["counts"].items()}


class ProtoNet(nn.Module):
    """Feature extractor + prototype library. `forward` gives logits over the whole library
    (in `library.labels` order); the state_dict holds the extractor only."""

    def __init__(self, extractor: nn.Module, dim: int) -> None:
        super().__init__()
        self.extractor = extractor
        self.dim = dim
        self.library = PrototypeLibrary(dim)

    def features_of(self, x: Tensor) -> Tensor:
        return self.extractor(x)

    def sampling(self) -> tuple[bool, torch.Generator | None]:
        """(whether this pass draws the rows, the generator of the draws): Gaussian rows are
        drawn exactly when the extractor's Bayesian layers draw their weights, from the same
        generator (so `bayes.predict_logits`'s seeded draws cover the rows too)."""
        if not self.library.gaussian:
            return False, None
        layers = bayesian_layers(self.extractor)
        if not layers or not layers[0][1].sampling:
            return False, None
        return True, layers[0][1].generator

    def forward(self, x: Tensor) -> Tensor:
        feats = self.extractor(x)
        draw, generator = self.sampling()
        if not draw:
            return self.library.logits(feats)
        lib = self.library
        return lib.logits(feats, lib.draw(lib.rows, lib.rho, generator))


def proto_model(model: nn.Module) -> ProtoNet:
    """An edgefcl model with its linear head replaced by a prototype library."""
    extractor, dim = split_head(model)
    return ProtoNet(extractor, dim)
