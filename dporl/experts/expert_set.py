"""ExpertSet: m queryable behaviour policies in one batched module, with the p_min guarantee the analysis needs.

The expert-level analysis (Sharma et al. 2024, Assumption 3) needs pi_i(a|s) >= p_min for every expert, action
and queried state. Two ways to get it:

- ``softening="argmax"`` (what the paper's data generator did): in every state the expert's most likely action gets
  ``1 - (n_A - 1) p_min`` and every other action exactly ``p_min``. The experts' logits only choose the best action;
  ties go to the lowest action index (``torch.argmax`` returns the first maximum), so the result is deterministic.
  Computed directly in log space: log p_min and log1p(-(n_A - 1) p_min).
- ``softening="none"``: the raw softmax of the logits. If ``p_min`` is given, every query checks that all
  probabilities are >= p_min and raises ``ValidationError("expert_set.p_min", ...)`` otherwise: an expert that breaks
  the assumption is a configuration error, never silently clipped. A private run's release queries with
  ``repair=True`` instead: an expert is one privacy unit, so a refusal there (after the run started) would turn one
  expert's near-deterministic state into an error where its neighbour gets a release. A repaired query mixes that
  expert's distribution in that state with the uniform one just enough to lift its smallest probability to p_min
  (``(1 - lam) pi + lam / n_A``); it depends on that expert alone, leaves every compliant state untouched, and the
  count of repaired (expert, state) queries (``repaired_queries``) is curator-only.

All queries are tensor ops over the stacked parameters of a ``StackedPolicy``; ``experts=`` (slice or indices)
evaluates a chunk of experts, which is how callers bound memory for thousands of experts.

Files are written atomically as one torch file of plain tensors and a JSON config string (no pickled code) and read
back with ``torch.load(weights_only=True)`` after the zip's sizes were bounded (``dporl.utils.io.load_weights``); the
config's nesting depth is bounded before it is parsed, and an environment id in its provenance that names a module
is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from dporl.experts.policies import FAMILIES, ExpertIndex, StackedPolicy
from dporl.envs.registry import check_no_module
from dporl.utils.io import atomic_torch_save, dump_json, load_weights, parse_json
from dporl.utils.validation import ValidationError, check_shape

Softening = Literal["argmax", "none"]
FORMAT_NAME = "dporl.expert_set"
FORMAT_VERSION = 1
# float32 softmax rounding: a probability equal to p_min up to ~1e-6 relative error is not a violation.
_LOG_TOLERANCE = 1e-5


class ExpertSet(nn.Module):
    """m experts over ``obs_dim``-dimensional states and ``n_actions`` actions, queried in one batched call.

    ``info`` is optional JSON-safe provenance (e.g. the physics setting and evaluation return of each expert); it is
    saved with the set and is part of ``reference()``.
    """

    def __init__(
        self,
        policy: StackedPolicy,
        p_min: float | None,
        softening: Softening = "argmax",
        info: dict[str, Any] | None = None,
    ):
        super().__init__()
        if not isinstance(policy, StackedPolicy):
            raise ValidationError("expert_set.policy", f"expected a StackedPolicy, got {type(policy).__name__}")
        if softening not in ("argmax", "none"):
            raise ValidationError("expert_set.softening", f"must be 'argmax' or 'none', got {softening!r}")
        if policy.n_actions < 2:
            raise ValidationError("expert_set.n_actions", f"need at least 2 actions, got {policy.n_actions}")
        self.policy = policy
        self.softening = softening
        self.p_min = check_p_min(p_min, policy.n_actions, softening)
        self.info = dict(info or {})
        _check_json_safe("expert_set.info", self.info)
        self._path: str | None = None
        self.repaired_queries = 0  # (expert, state) queries repaired to p_min (module docstring): curator-only

    # ------------------------------------------------------------------ shape properties
    @property
    def n_experts(self) -> int:
        return self.policy.n_experts

    @property
    def n_actions(self) -> int:
        return self.policy.n_actions

    @property
    def obs_dim(self) -> int:
        return self.policy.obs_dim

    @property
    def path(self) -> str | None:
        """The file this set was loaded from or last saved to (None for a set built in memory)."""
        return self._path

    # ------------------------------------------------------------------ queries
    @torch.no_grad()
    def log_probs(self, states: torch.Tensor, experts: ExpertIndex = None, *, repair: bool = False) -> torch.Tensor:
        """states [B, obs_dim] -> log pi_i(. | s_b) as [m', B, n_actions] for the selected experts (``repair``: lift a
        distribution below p_min instead of refusing it; module docstring)."""
        states = self._as_states(states, 2)
        return self._soften(self.policy.forward_all(states, experts), repair)

    @torch.no_grad()
    def log_prob_of(self, states: torch.Tensor, actions: torch.Tensor, experts: ExpertIndex = None) -> torch.Tensor:
        """log pi_i(a_b | s_b) for every selected expert i: states [B, d], actions [B] -> [m', B]."""
        states = self._as_states(states, 2)
        actions = torch.as_tensor(actions, device=states.device)
        if actions.shape != states.shape[:1]:
            raise ValidationError("actions", f"expected shape ({states.shape[0]},), got {tuple(actions.shape)}")
        if actions.numel() and (int(actions.min()) < 0 or int(actions.max()) >= self.n_actions):
            raise ValidationError("actions", f"must lie in [0, {self.n_actions})")
        log_probs = self.log_probs(states, experts)
        index = actions.long().view(1, -1, 1).expand(log_probs.shape[0], -1, 1)
        return log_probs.gather(2, index).squeeze(2)

    @torch.no_grad()
    def log_probs_paired(self, states: torch.Tensor, experts: ExpertIndex = None) -> torch.Tensor:
        """states [m', B, obs_dim] (row i for the i-th selected expert) -> [m', B, n_actions]."""
        states = self._as_states(states, 3)
        return self._soften(self.policy.forward_paired(states, experts))

    @torch.no_grad()
    def sample(self, states: torch.Tensor, generator: torch.Generator, experts: ExpertIndex = None) -> torch.Tensor:
        """One action per (expert, state) from the softened policies: states [m', B, d] -> LongTensor [m', B]."""
        return sample_from_log_probs(self.log_probs_paired(states, experts), generator)

    def select(self, experts: ExpertIndex) -> "ExpertSet":
        """A new ExpertSet holding the chosen experts (in that order), same p_min and softening."""
        info = dict(self.info)
        per_expert = info.pop("per_expert", None)
        if per_expert is not None:
            index = range(self.n_experts)[experts] if isinstance(experts, slice) else torch.as_tensor(experts).tolist()
            info["per_expert"] = {key: [values[i] for i in index] for key, values in per_expert.items()}
        return ExpertSet(self.policy.select(experts), self.p_min, self.softening, info)

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> Path:
        """Write the set atomically: plain tensors + a JSON config (no code is pickled)."""
        config = {
            "family": self.policy.family,
            "family_config": self.policy.config(),
            "p_min": self.p_min,
            "softening": self.softening,
            "info": self.info,
        }
        payload = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "config_json": dump_json(config, sort_keys=True),
            "state_dict": {k: v.detach().cpu().contiguous() for k, v in self.policy.state_dict().items()},
        }
        atomic_torch_save(path, payload)
        self._path = str(path)
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, map_location: str | torch.device = "cpu") -> "ExpertSet":
        path = Path(path)
        # Weights-only, with the zip's sizes bounded before anything is inflated (dporl.utils.io.load_weights).
        payload = load_weights(path, "expert_set.path", map_location)
        if not isinstance(payload, dict) or payload.get("format") != FORMAT_NAME:
            raise ValidationError("expert_set.format", f"{path} is not a {FORMAT_NAME} file")
        if payload.get("format_version") != FORMAT_VERSION:
            raise ValidationError("expert_set.format_version", f"unsupported version {payload.get('format_version')!r}")
        config = _read_config(payload, path)
        family = config.get("family")
        if family not in FAMILIES:
            raise ValidationError("expert_set.family", f"unknown policy family {family!r} (known: {sorted(FAMILIES)})")
        policy = FAMILIES[family].from_config(config["family_config"])
        try:
            policy.load_state_dict(payload["state_dict"])
        except RuntimeError as exc:
            raise ValidationError("expert_set.state_dict", f"does not match the {family} config: {exc}") from None
        for name, tensor in policy.state_dict().items():
            if not torch.isfinite(tensor).all():
                raise ValidationError(f"expert_set.state_dict.{name}", "contains NaN or inf")
        expert_set = cls(policy, config["p_min"], config["softening"], config.get("info"))
        expert_set._path = str(path)
        return expert_set.to(map_location)

    def fingerprint(self) -> str:
        """sha256 over the family config, p_min, softening and every parameter's bytes (identifies the experts)."""
        digest = hashlib.sha256()
        digest.update(dump_json([self.policy.family, self.policy.config(), self.p_min, self.softening]).encode())
        for name, tensor in sorted(self.policy.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()

    def reference(self) -> dict[str, Any]:
        """JSON-safe description for ``DatasetMetadata.expert_set``: what produced a dataset, checkable by hash."""
        return {
            "path": self._path,
            "family": self.policy.family,
            "n_experts": self.n_experts,
            "n_actions": self.n_actions,
            "obs_dim": self.obs_dim,
            "p_min": self.p_min,
            "softening": self.softening,
            "sha256": self.fingerprint(),
            "source": self.info.get("source"),
        }

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, n_actions={self.n_actions}, p_min={self.p_min}, softening={self.softening}"

    # ------------------------------------------------------------------ internals
    def _as_states(self, states: torch.Tensor, ndim: int) -> torch.Tensor:
        reference = next(self.policy.parameters())
        states = torch.as_tensor(states).to(device=reference.device, dtype=reference.dtype)
        check_shape("states", states, [None] * (ndim - 1) + [self.obs_dim])
        return states

    def _soften(self, logits: torch.Tensor, repair: bool = False) -> torch.Tensor:
        """Log-probabilities from fresh ``logits`` (overwritten in place: they are a temporary of this query).

        In-place on purpose: large temporaries dominate the query cost on CPU (every fresh [m, B, A] tensor is
        new memory to fault in), and the plain matmul producing the logits is cheap by comparison.
        """
        if self.softening == "argmax":
            best = logits.argmax(dim=-1, keepdim=True)  # first maximum on ties: deterministic
            log_best = math.log1p(-(self.n_actions - 1) * self.p_min)
            return logits.fill_(math.log(self.p_min)).scatter_(-1, best, log_best)
        log_probs = logits.sub_(logits.logsumexp(dim=-1, keepdim=True))
        if self.p_min is not None and log_probs.numel():
            threshold = math.log(self.p_min) - _LOG_TOLERANCE
            if float(log_probs.amin()) < threshold and repair:
                return self._repair(log_probs)
            if float(log_probs.amin()) < threshold:
                low = log_probs < threshold
                expert, state, action = (int(i) for i in low.nonzero()[0])
                worst = float(log_probs.amin().exp())
                raise ValidationError(
                    "expert_set.p_min",
                    f"{int(low.sum())} queried probabilities are below p_min={self.p_min} (smallest {worst:.3g}; first: "
                    f"expert {expert} of this query, state {state}, action {action}); use softening='argmax' "
                    "or experts that satisfy p_min",
                )
        return log_probs


    def _repair(self, log_probs: torch.Tensor) -> torch.Tensor:
        """Each (expert, state) whose smallest probability is below p_min, mixed with the uniform distribution by the
        smallest lam that lifts it to p_min: (1 - lam) pi + lam / n_A, lam = (p_min - min pi) / (1 / n_A - min pi)."""
        probs = log_probs.exp()
        low = probs.amin(dim=-1, keepdim=True)
        need = low < self.p_min
        uniform = 1.0 / self.n_actions
        lam = ((self.p_min - low) / (uniform - low).clamp_min(1e-300)).clamp(0.0, 1.0)
        repaired = ((1 - lam) * probs + lam * uniform).log()
        self.repaired_queries += int(need.sum())
        return torch.where(need, repaired, log_probs)


def sample_from_log_probs(log_probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Inverse-CDF sampling of one action per row of ``log_probs[..., n_actions]`` (one uniform per row)."""
    # Drawn where the (secret, CPU) generator lives, then moved: a CPU generator cannot fill an accelerator tensor.
    uniform = torch.rand(log_probs.shape[:-1], generator=generator, dtype=log_probs.dtype, device=generator.device)
    return sample_with_uniforms(log_probs, uniform)


def sample_with_uniforms(log_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row r of ``log_probs[..., n_actions]`` takes its action from ``uniforms[r]`` in [0, 1)."""
    cdf = log_probs.exp().cumsum(dim=-1)
    uniforms = uniforms.to(device=cdf.device, dtype=cdf.dtype).unsqueeze(-1)
    # Scale by the total so float rounding in the cumulative sum never leaves mass past the last action.
    actions = (cdf < uniforms * cdf[..., -1:]).sum(dim=-1)
    return actions.clamp_(max=log_probs.shape[-1] - 1)


def check_p_min(p_min: float | None, n_actions: int, softening: str) -> float | None:
    """The p_min an ExpertSet accepts: (0, 1/n_A) for argmax softening, (0, 1/n_A] or None for raw softmax."""
    if p_min is None:
        if softening == "argmax":
            raise ValidationError("expert_set.p_min", "argmax softening needs a p_min in (0, 1/n_actions)")
        return None
    if isinstance(p_min, bool) or not isinstance(p_min, (int, float)) or not math.isfinite(p_min):
        raise ValidationError("expert_set.p_min", f"expected a finite number, got {p_min!r}")
    p_min = float(p_min)
    # argmax needs a strictly most likely action: p_min = 1/n_A would make every action equally likely.
    upper_ok = p_min < 1.0 / n_actions if softening == "argmax" else p_min <= 1.0 / n_actions
    if not (p_min > 0 and upper_ok):
        bound = ")" if softening == "argmax" else "]"
        raise ValidationError("expert_set.p_min", f"must lie in (0, 1/n_actions = {1.0 / n_actions:.6g}{bound}, got {p_min}")
    return p_min


def _check_json_safe(field: str, value: Any) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValidationError(field, f"must be JSON-serialisable with finite numbers: {exc}") from None


def _read_config(payload: dict, path: Path) -> dict:
    """The file's JSON config with every key ``load`` reads; a missing or malformed one is named."""
    raw = payload.get("config_json")
    if not isinstance(raw, str):
        raise ValidationError("expert_set.config_json", f"{path} has no JSON config string")
    config = parse_json(raw, "expert_set.config_json")  # nesting depth bounded before the parser recurses
    if not isinstance(config, dict):
        raise ValidationError("expert_set.config_json", f"expected a JSON object, got {type(config).__name__}")
    for key, kind in (("family", str), ("family_config", dict), ("softening", str)):
        if not isinstance(config.get(key), kind):
            raise ValidationError(f"expert_set.config_json.{key}", f"expected a {kind.__name__}, got {config.get(key)!r}")
    if "p_min" not in config:
        raise ValidationError("expert_set.config_json.p_min", "missing")
    generation = (config.get("info") or {}).get("generation") if isinstance(config.get("info"), dict) else None
    if isinstance(generation, dict) and "env_id" in generation:  # provenance: a name, never a module to import
        check_no_module("expert_set.info.generation.env_id", generation["env_id"])
    if not isinstance(payload.get("state_dict"), dict):
        raise ValidationError("expert_set.state_dict", f"{path} holds no state_dict")
    return config
