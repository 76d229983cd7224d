"""Gaussian-process noise paths: functional noise for releasing a function (Wang & Hegde 2019, seeds/004).

A released function f + g, with g a sample path of GP(0, sigma^2 K), is private with respect to changes of f that
are small in the kernel's RKHS norm (Hall, Rinaldo & Wasserman 2013). A sample path is an infinite object, so it is
sampled lazily: the first time a point is queried its value is drawn from the exact conditional distribution given
every value drawn so far, stored, and returned again on every later query. The joint law of everything ever
returned is therefore exactly the GP's, in whatever order points are asked for.

Kernel K(x, y) = exp(-beta ||x - y||_1) on states scaled to [0, 1]^d (the caller scales; the theorem assumes it).

* d = 1 (``OrnsteinUhlenbeckPath``): the process is Ornstein-Uhlenbeck, hence Markov, so a new point depends only
  on its nearest stored neighbours s- < s < s+. With a = exp(-beta (s - s-)), b = exp(-beta (s+ - s)):
      mean = [a (1 - b^2) g(s-) + b (1 - a^2) g(s+)] / (1 - a^2 b^2),
      var  = sigma^2 (1 - a^2)(1 - b^2) / (1 - a^2 b^2)
  (the Ornstein-Uhlenbeck bridge; Wang & Hegde 2019's appendix swaps the two weights). One neighbour x0: mean e^{-beta d} g(x0),
  var sigma^2 (1 - e^{-2 beta d}); none: N(0, sigma^2). Neighbours are found by bisection in sorted storage:
  O(log n) comparisons per new point (the insertion itself is a memmove of n pointers, negligible up to ~1e6).
* d > 1 (``LaplaceKernelPath``): no Markov shortcut. Exact conditioning on every stored point of the current
  window through an incrementally grown Cholesky factor L of K(X, X): a new point costs one triangular solve,
  O(n^2); a batch of m new points is one block update (one triangular solve with m right-hand sides and an
  m x m Cholesky of their joint conditional covariance), which is the same sequential conditioning in sorted
  order. The window stays small because Algorithm 1 resets its paths every T / (J B) iterations.

Batched queries: unique points are processed in sorted order, each conditioned on everything stored before it
(including earlier points of the same batch), which is exact sequential sampling of the joint conditional law;
the result does not depend on the order of the batch. All randomness comes from a ``NoiseSource``.

Privacy note: the stored values and the generator state are part of the released object (a path must answer
consistently after release). Noise drawn for paths that were reset during training is NOT released; call
``reseed(NoiseSource())`` before publishing so the published generator state reveals nothing about those draws.
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Optional

import torch

from dporl.privacy.noise import NoiseSource
from dporl.utils.validation import ValidationError, check_positive

# A new point whose conditional variance is below this fraction of sigma^2 is determined by its neighbours to
# ~1e-6 sigma: it gets its conditional mean and is not stored (storing it would make the multi-dimensional
# Cholesky factor singular). A later query of it returns the then-current conditional mean, equal up to that size.
_DETERMINED_VARIANCE = 1e-12


class _PathBase:
    def __init__(self, dim: int, sigma: float, beta: float, noise: NoiseSource):
        if dim < 1:
            raise ValidationError("gp_noise.dim", f"must be >= 1, got {dim}")
        self.dim = dim
        self.sigma = check_positive("gp_noise.sigma", sigma, allow_zero=True)
        self.beta = check_positive("gp_noise.beta", beta)
        self.noise = noise

    def reseed(self, noise: NoiseSource) -> None:
        self.noise = noise

    def _points(self, points: torch.Tensor) -> torch.Tensor:
        points = torch.as_tensor(points)
        if self.dim == 1 and (points.dim() == 0 or points.shape[-1] != 1):
            points = points.unsqueeze(-1)  # 1-D paths accept [...] as well as [..., 1]
        if points.shape[-1] != self.dim:
            raise ValidationError("points", f"expected [..., {self.dim}], got {tuple(points.shape)}")
        if points.is_floating_point() and not bool(torch.isfinite(points).all()):
            raise ValidationError("points", "contains non-finite values (NaN or inf)")
        return points

    def __call__(self, points: torch.Tensor) -> torch.Tensor:
        """g(points): values [...] for points [..., dim] (1-D: [...] or [..., 1]), in the points' float dtype."""
        points = self._points(points)
        dtype = points.dtype if points.is_floating_point() else torch.float32
        batch_shape = points.shape[:-1]
        flat = points.detach().reshape(-1, self.dim).to("cpu", torch.float64)
        if self.sigma == 0:
            return torch.zeros(batch_shape, dtype=dtype, device=points.device)
        keys = [tuple(row) for row in flat.tolist()]
        values = self._values(keys)
        out = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        return out.reshape(batch_shape).to(points.device, dtype)


class OrnsteinUhlenbeckPath(_PathBase):
    """A lazily sampled path of GP(0, sigma^2 exp(-beta |x - y|)) on the real line."""

    def __init__(self, sigma: float, beta: float, noise: NoiseSource):
        super().__init__(1, sigma, beta, noise)
        self.reset()

    def reset(self) -> None:
        """Forget the path: later queries sample a fresh, independent one."""
        self._xs: list[float] = []
        self._gs: list[float] = []
        self._stored: dict[float, float] = {}

    @property
    def n_points(self) -> int:
        return len(self._xs)

    def conditional(self, x: float) -> tuple[float, float]:
        """(mean, variance) of g(x) given the stored values (variance 0 at a stored point)."""
        x = float(x)
        if x in self._stored:
            return self._stored[x], 0.0
        i = bisect.bisect_left(self._xs, x)
        s2 = self.sigma**2
        left = i > 0
        right = i < len(self._xs)
        if left and right:
            dl, dr = x - self._xs[i - 1], self._xs[i] - x
            a, b = math.exp(-self.beta * dl), math.exp(-self.beta * dr)
            one_minus_a2 = -math.expm1(-2 * self.beta * dl)
            one_minus_b2 = -math.expm1(-2 * self.beta * dr)
            denom = -math.expm1(-2 * self.beta * (dl + dr))  # 1 - a^2 b^2, accurate when both gaps are tiny
            mean = (a * one_minus_b2 * self._gs[i - 1] + b * one_minus_a2 * self._gs[i]) / denom
            return mean, s2 * one_minus_a2 * one_minus_b2 / denom
        if left or right:
            j = i - 1 if left else i
            d = abs(x - self._xs[j])
            return math.exp(-self.beta * d) * self._gs[j], s2 * -math.expm1(-2 * self.beta * d)
        return 0.0, s2

    def _values(self, keys: list[tuple[float, ...]]) -> dict[tuple[float, ...], float]:
        points = sorted({k[0] for k in keys})
        new = [x for x in points if x not in self._stored]
        draws = self.noise.gaussian(len(new), 1.0, dtype=torch.float64).tolist() if new else []
        for x, z in zip(new, draws):
            mean, var = self.conditional(x)
            if var <= _DETERMINED_VARIANCE * self.sigma**2:
                continue
            value = mean + math.sqrt(var) * z
            i = bisect.bisect_left(self._xs, x)
            self._xs.insert(i, x)
            self._gs.insert(i, value)
            self._stored[x] = value
        return {(x,): self.conditional(x)[0] if x not in self._stored else self._stored[x] for x in points}

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "ou",
            "sigma": self.sigma,
            "beta": self.beta,
            "x": torch.tensor(self._xs, dtype=torch.float64),
            "g": torch.tensor(self._gs, dtype=torch.float64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(self, state, "ou")
        self._xs = state["x"].tolist()
        self._gs = state["g"].tolist()
        if any(b <= a for a, b in zip(self._xs, self._xs[1:])):
            raise ValidationError("gp_noise.x", "stored points must be strictly increasing")
        self._stored = dict(zip(self._xs, self._gs))


class LaplaceKernelPath(_PathBase):
    """A lazily sampled path of GP(0, sigma^2 exp(-beta ||x - y||_1)) on R^d, by exact Cholesky conditioning.

    Invariants: ``_chol[:n, :n]`` is the Cholesky factor of K(X, X) / sigma^2 and ``_white = L^{-1} g / sigma``
    (the standard normals that generated the stored values), so a new point x with k = K(X, x) / sigma^2 and
    w = L^{-1} k has mean sigma w . white, variance sigma^2 (1 - w . w), and appends row [w, sqrt(1 - w . w)].
    """

    def __init__(self, dim: int, sigma: float, beta: float, noise: NoiseSource, capacity: int = 64):
        super().__init__(dim, sigma, beta, noise)
        self._initial_capacity = max(1, int(capacity))
        self.reset()

    def reset(self) -> None:
        self._n = 0
        self._x = torch.empty(self._initial_capacity, self.dim, dtype=torch.float64)
        self._chol = torch.zeros(self._initial_capacity, self._initial_capacity, dtype=torch.float64)
        self._white = torch.empty(self._initial_capacity, dtype=torch.float64)
        self._g = torch.empty(self._initial_capacity, dtype=torch.float64)
        self._stored: dict[tuple[float, ...], float] = {}

    @property
    def n_points(self) -> int:
        return self._n

    def _solve(self, x: torch.Tensor) -> torch.Tensor:
        n = self._n
        k = torch.exp(-self.beta * (self._x[:n] - x).abs().sum(dim=1))
        return torch.linalg.solve_triangular(self._chol[:n, :n], k.unsqueeze(1), upper=False).squeeze(1)

    def conditional(self, x: torch.Tensor | tuple[float, ...]) -> tuple[float, float]:
        """(mean, variance) of g(x) given the stored values."""
        key = tuple(float(v) for v in torch.as_tensor(x, dtype=torch.float64).reshape(-1).tolist())
        if key in self._stored:
            return self._stored[key], 0.0
        if self._n == 0:
            return 0.0, self.sigma**2
        w = self._solve(torch.tensor(key, dtype=torch.float64))
        residual = max(1.0 - float(w @ w), 0.0)
        return self.sigma * float(w @ self._white[: self._n]), self.sigma**2 * residual

    def _grow(self) -> None:
        capacity = 2 * self._x.shape[0]
        x = torch.empty(capacity, self.dim, dtype=torch.float64)
        chol = torch.zeros(capacity, capacity, dtype=torch.float64)
        white = torch.empty(capacity, dtype=torch.float64)
        g = torch.empty(capacity, dtype=torch.float64)
        n = self._n
        x[:n], chol[:n, :n], white[:n], g[:n] = self._x[:n], self._chol[:n, :n], self._white[:n], self._g[:n]
        self._x, self._chol, self._white, self._g = x, chol, white, g

    def _values(self, keys: list[tuple[float, ...]]) -> dict[tuple[float, ...], float]:
        points = sorted(set(keys))
        new = [p for p in points if p not in self._stored]
        draws = self.noise.gaussian(len(new), 1.0, dtype=torch.float64) if new else None
        if new and not self._append_block(new, draws):
            self._append_sequential(new, draws.tolist())
        return {p: self._stored[p] if p in self._stored else self.conditional(p)[0] for p in points}

    def _append_block(self, new: list[tuple[float, ...]], draws: torch.Tensor) -> bool:
        """All new points at once: the Cholesky factor of their joint conditional covariance, in sorted order, is
        sequential conditioning in that order, so this equals ``_append_sequential`` up to rounding. Returns False
        (appending nothing) when some point is determined by the others; the sequential path then skips it."""
        n, m = self._n, len(new)
        x_new = torch.tensor(new, dtype=torch.float64)
        cov = torch.exp(-self.beta * torch.cdist(x_new, x_new, p=1))
        if n:
            cross = torch.exp(-self.beta * torch.cdist(self._x[:n], x_new, p=1))
            w = torch.linalg.solve_triangular(self._chol[:n, :n], cross, upper=False)  # [n, m]
            mean = self.sigma * (w.T @ self._white[:n])
            cov = cov - w.T @ w
        else:
            w, mean = torch.empty(0, m, dtype=torch.float64), torch.zeros(m, dtype=torch.float64)
        block, info = torch.linalg.cholesky_ex(cov)
        if int(info) != 0 or float(block.diagonal().min()) ** 2 <= _DETERMINED_VARIANCE:
            return False
        while n + m > self._x.shape[0]:
            self._grow()
        values = mean + self.sigma * (block @ draws)
        self._x[n : n + m] = x_new
        self._chol[n : n + m, :n] = w.T
        self._chol[n : n + m, n : n + m] = block
        self._white[n : n + m] = draws
        self._g[n : n + m] = values
        self._n = n + m
        self._stored.update(zip(new, values.tolist()))
        return True

    def _append_sequential(self, new: list[tuple[float, ...]], draws: list[float]) -> None:
        for key, z in zip(new, draws):
            x = torch.tensor(key, dtype=torch.float64)
            n = self._n
            w = self._solve(x) if n else torch.empty(0, dtype=torch.float64)
            residual = 1.0 - float(w @ w)
            if residual <= _DETERMINED_VARIANCE:
                continue  # determined by its neighbours: answered by its conditional mean, not stored
            mean = self.sigma * float(w @ self._white[:n]) if n else 0.0
            if n == self._x.shape[0]:
                self._grow()
            diag = math.sqrt(residual)
            self._x[n] = x
            self._chol[n, :n] = w
            self._chol[n, n] = diag
            self._white[n] = z
            value = mean + self.sigma * diag * z
            self._g[n] = value
            self._n = n + 1
            self._stored[key] = value

    def state_dict(self) -> dict[str, Any]:
        n = self._n
        return {
            "kind": "laplace",
            "sigma": self.sigma,
            "beta": self.beta,
            "dim": self.dim,
            "x": self._x[:n].clone(),
            "g": self._g[:n].clone(),
            "chol": self._chol[:n, :n].clone(),
            "white": self._white[:n].clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(self, state, "laplace")
        if int(state["dim"]) != self.dim:
            raise ValidationError("gp_noise.dim", f"state has dim {state['dim']}, path has {self.dim}")
        n = int(state["x"].shape[0])
        self._initial_capacity = max(self._initial_capacity, n)
        self.reset()
        self._x[:n] = state["x"]
        self._g[:n] = state["g"]
        self._chol[:n, :n] = state["chol"]
        self._white[:n] = state["white"]
        self._n = n
        self._stored = {tuple(row): float(v) for row, v in zip(state["x"].tolist(), state["g"].tolist())}
        self._initial_capacity = 64


def _check_state(path: _PathBase, state: dict[str, Any], kind: str) -> None:
    if state.get("kind") != kind:
        raise ValidationError("gp_noise.kind", f"state is of kind {state.get('kind')!r}, path is {kind!r}")
    if float(state["sigma"]) != path.sigma or float(state["beta"]) != path.beta:
        raise ValidationError(
            "gp_noise.sigma", f"state has (sigma, beta) = ({state['sigma']}, {state['beta']}), path has "
            f"({path.sigma}, {path.beta})"
        )


def make_path(dim: int, sigma: float, beta: float, noise: NoiseSource) -> OrnsteinUhlenbeckPath | LaplaceKernelPath:
    """The fast Markov path in one dimension, exact Cholesky conditioning otherwise."""
    if dim == 1:
        return OrnsteinUhlenbeckPath(sigma, beta, noise)
    return LaplaceKernelPath(dim, sigma, beta, noise)


def laplace_kernel(x: torch.Tensor, y: torch.Tensor, sigma: float, beta: float) -> torch.Tensor:
    """sigma^2 exp(-beta ||x_i - y_j||_1) for x [n, d], y [m, d] (dense reference; tests and benchmarks)."""
    return sigma**2 * torch.exp(-beta * torch.cdist(x, y, p=1))


def dense_conditional(
    stored_x: torch.Tensor, stored_g: torch.Tensor, query: torch.Tensor, sigma: float, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact GP conditioning by a dense Cholesky of K(X, X): (means [m], variances [m]) at query [m, d]."""
    if stored_x.shape[0] == 0:
        return torch.zeros(query.shape[0], dtype=query.dtype), torch.full((query.shape[0],), sigma**2)
    chol = torch.linalg.cholesky(laplace_kernel(stored_x, stored_x, sigma, beta))
    cross = laplace_kernel(stored_x, query, sigma, beta)
    w = torch.linalg.solve_triangular(chol, cross, upper=False)
    white = torch.linalg.solve_triangular(chol, stored_g.unsqueeze(1), upper=False).squeeze(1)
    return w.T @ white, sigma**2 - (w * w).sum(0)


class FunctionalNoise(torch.nn.Module):
    """One independent noise path per action, on states scaled by public bounds to [0, 1]^d.

    ``forward(states [..., d]) -> [..., n_actions]`` extends every action's path at the queried states (Algorithm 1
    lines 14-18). Paths, their stored values and the generator state travel in the module's ``state_dict`` (as extra
    state), so a saved and reloaded module answers every query identically.
    """

    def __init__(
        self,
        n_actions: int,
        state_low: list[float],
        state_high: list[float],
        sigma: float,
        beta: float,
        noise: Optional[NoiseSource] = None,
    ):
        super().__init__()
        if n_actions < 1:
            raise ValidationError("n_actions", f"must be >= 1, got {n_actions}")
        low = torch.as_tensor(state_low, dtype=torch.float64).reshape(-1)
        high = torch.as_tensor(state_high, dtype=torch.float64).reshape(-1)
        if low.shape != high.shape or not bool((high > low).all()):
            raise ValidationError("state_high", f"need state_high > state_low elementwise, got {low} / {high}")
        self.register_buffer("state_low", low, persistent=False)
        self.register_buffer("state_scale", high - low, persistent=False)
        self.dim = int(low.numel())
        self.sigma = check_positive("gp_noise.sigma", sigma, allow_zero=True)
        self.beta = check_positive("gp_noise.beta", beta)
        self.noise = noise if noise is not None else NoiseSource()
        self.paths = [make_path(self.dim, self.sigma, self.beta, self.noise) for _ in range(n_actions)]

    @property
    def n_actions(self) -> int:
        return len(self.paths)

    def scale(self, states: torch.Tensor) -> torch.Tensor:
        """States [..., d] (or [...] when d = 1) to [..., d] in the unit cube of the public bounds."""
        if self.dim == 1 and (states.dim() == 0 or states.shape[-1] != 1):
            states = states.unsqueeze(-1)
        return (states.to(torch.float64) - self.state_low.cpu()) / self.state_scale.cpu()

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        scaled = self.scale(states.detach().cpu())
        values = torch.stack([path(scaled) for path in self.paths], dim=-1)
        return values.to(states.device, states.dtype if states.is_floating_point() else torch.float32)

    def reset(self) -> None:
        for path in self.paths:
            path.reset()

    def reseed(self, noise: NoiseSource) -> None:
        self.noise = noise
        for path in self.paths:
            path.reseed(noise)

    @property
    def n_points(self) -> int:
        return sum(path.n_points for path in self.paths)

    def get_extra_state(self) -> dict[str, Any]:
        return {"paths": [path.state_dict() for path in self.paths], "noise": self.noise.state_dict()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if len(state["paths"]) != self.n_actions:
            raise ValidationError("n_actions", f"state has {len(state['paths'])} paths, module has {self.n_actions}")
        for path, path_state in zip(self.paths, state["paths"]):
            path.load_state_dict(path_state)
        self.noise.load_state_dict(state["noise"])
