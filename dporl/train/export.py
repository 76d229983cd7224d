"""Released policies: weights, a JSON description and a TorchScript file; deployable without dporl's trainer.

A policy directory (``RUN/release/policy/``) holds exactly what the guarantee covers of a trained model::

    weights.pt              the network's plain state_dict: ``torch.load(path, weights_only=True)``
    policy.json             format, kind, architecture, observation / action spaces, environment id, the guarantee,
                            and the sha256 of both weight files
    policy.torchscript.pt   ``torch.jit.load(path)(obs)`` -> greedy actions (``.scores(obs)``: the network's outputs)

No optimizer state, no generator state, no noise seed, no private count: a policy file is a function of the final
iterate only. ``save_policy(module, directory, ...)`` writes it (atomically, file by file, ``policy.json`` last);
``load_policy(directory)`` reads it back weights-only, checking every declared size against bounds before it
allocates anything, the recorded hashes, that its kind is one a registered algorithm releases
(``dporl.algos.registry``), and that its environment id names no module (``dporl.envs.registry``). ``GreedyPolicy``
is a plain ``nn.Module`` with ``act(obs)``: the argmax of an MLP's outputs (Q-values for CQL's kind, logits for
behaviour cloning's).

TorchScript is what the issue asked for and runs in C++ (libtorch) too; torch 2.13 marks ``torch.jit`` deprecated
in favour of ``torch.export``, so the state_dict + JSON pair is the format dporl itself reads and the one to rely
on; the TorchScript file is a convenience for deployment.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from dporl.algos.base import ContractError, declaration_of
from dporl.algos.networks import check_mlp_sizes, mlp
from dporl.algos.registry import policy_kinds
from dporl.envs.registry import check_no_module
from dporl.utils.io import atomic_torch_save, atomic_write, atomic_write_json, load_weights, read_json, sha256_file
from dporl.utils.validation import ValidationError

POLICY_FORMAT = "dporl-policy"
POLICY_VERSION = 1
WEIGHTS_FILE = "weights.pt"
SPEC_FILE = "policy.json"
TORCHSCRIPT_FILE = "policy.torchscript.pt"
# A greedy MLP whose outputs' meaning is not declared (built by hand, not by a registered algorithm).
GENERIC_KIND = "greedy_mlp"


def known_kinds() -> list[str]:
    """The policy kinds ``load_policy`` reads: every registered algorithm's (``dporl.algos.registry``) and the
    generic greedy MLP."""
    return sorted({GENERIC_KIND, *policy_kinds()})


class GreedyPolicy(nn.Module):
    """The greedy policy of an MLP obs_dim -> hidden_sizes (ReLU) -> n_actions: act(obs) = argmax of its outputs.

    ``kind`` says what the outputs are (the releasing algorithm's declared policy kind: Q-values for
    "greedy_q_mlp", action logits for "greedy_logits_mlp"); the action rule is the same argmax."""

    def __init__(self, obs_dim: int, hidden_sizes: list[int], n_actions: int, spec: Optional[Mapping[str, Any]] = None,
                 kind: str = GENERIC_KIND):
        super().__init__()
        obs_dim, hidden_sizes, n_actions = check_mlp_sizes("policy.architecture", obs_dim, list(hidden_sizes), n_actions)
        self.obs_dim, self.hidden_sizes, self.n_actions = obs_dim, hidden_sizes, n_actions
        self.kind = kind
        self.network = mlp(obs_dim, hidden_sizes, n_actions)
        self.spec: dict[str, Any] = dict(spec or {})  # policy.json when loaded (spaces, env id, guarantee)

    @classmethod
    def from_network(cls, network: nn.Module, kind: str = GENERIC_KIND) -> "GreedyPolicy":
        """A copy of an ``nn.Sequential`` of Linear / ReLU layers (what ``dporl.algos.networks.mlp`` builds)."""
        layers = list(network) if isinstance(network, nn.Sequential) else []
        linear = [layer for layer in layers if isinstance(layer, nn.Linear)]
        if not linear or any(not isinstance(layer, (nn.Linear, nn.ReLU)) for layer in layers):
            raise ValidationError("policy", "only MLP policy networks (Linear / ReLU) can be exported as greedy policies")
        policy = cls(linear[0].in_features, [layer.out_features for layer in linear[:-1]], linear[-1].out_features,
                     kind=kind)
        policy.network.load_state_dict({k: v.detach().cpu() for k, v in network.state_dict().items()})
        return policy

    @classmethod
    def of(cls, algorithm: Any) -> "GreedyPolicy":
        """The released policy of a ``PrivateAlgorithm`` that declares a policy kind: a copy of its policy network."""
        kind = declaration_of(algorithm).policy_kind
        if kind is None:
            raise ContractError("algorithm.policy_kind", f"{type(algorithm).__name__} releases no policy")
        return cls.from_network(algorithm.policy_network(), kind)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """The network's outputs [B, n_actions] (Q-values or logits, as ``kind`` says) for observations [B, obs_dim]."""
        return self.network(obs)

    @torch.no_grad()
    def act(self, obs: torch.Tensor) -> torch.Tensor:
        """Greedy actions [B] (LongTensor) for observations [B, obs_dim]."""
        obs = torch.as_tensor(obs, dtype=torch.float32, device=next(self.parameters()).device)
        return self.network(obs).argmax(dim=-1)

    def architecture(self) -> dict[str, Any]:
        return {"obs_dim": self.obs_dim, "hidden_sizes": list(self.hidden_sizes), "n_actions": self.n_actions,
                "activation": "relu"}

    def save(self, directory: str | Path, **description: Any) -> Path:
        """``save_policy(self, directory, **description)``."""
        return save_policy(self, directory, **description)


class _ScriptedGreedy(nn.Module):
    """What the TorchScript file holds: forward = greedy actions, scores = the network's outputs."""

    def __init__(self, network: nn.Module):
        super().__init__()
        self.network = network

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.network(obs).argmax(dim=-1)

    @torch.jit.export
    def scores(self, obs: torch.Tensor) -> torch.Tensor:
        return self.network(obs)


def space_to_dict(space: Any) -> Optional[dict[str, Any]]:
    """JSON description of a Gymnasium Box / Discrete space (None for None)."""
    if space is None:
        return None
    if hasattr(space, "n"):
        return {"type": "Discrete", "n": int(space.n)}
    if hasattr(space, "low") and hasattr(space, "high"):
        return {"type": "Box", "shape": list(space.shape), "dtype": str(space.dtype),
                "low": [float(x) for x in space.low.ravel()], "high": [float(x) for x in space.high.ravel()]}
    raise ValidationError("policy.space", f"cannot describe space {space!r}")


def _with_labels(space: Optional[dict[str, Any]], labels: Optional[Sequence[Any]]) -> Optional[dict[str, Any]]:
    if labels is None:
        return space
    if space is None or space.get("type") != "Discrete" or space["n"] != len(labels):
        raise ValidationError("policy.action_labels", f"{len(labels)} labels for action space {space!r}")
    return {**space, "labels": list(labels)}


def save_policy(
    module: nn.Module,
    directory: str | Path,
    *,
    env_id: Optional[str] = None,
    observation_space: Any = None,
    action_space: Any = None,
    privacy: Optional[Mapping[str, Any]] = None,
    extra: Optional[Mapping[str, Any]] = None,
    action_labels: Optional[Sequence[Any]] = None,
) -> Path:
    """Write ``module`` (a ``GreedyPolicy``, or a ``PrivateAlgorithm`` declaring a policy kind) as a policy directory.

    ``privacy``: what the guarantee says (``PrivacyReport.to_dict()`` or a subset). ``action_labels``: the declared
    label of each action index (public), recorded in the action space. ``policy.json`` is written last: a directory
    without it is incomplete.
    """
    policy = module if isinstance(module, GreedyPolicy) else GreedyPolicy.of(module)
    policy = copy.deepcopy(policy).cpu().eval()
    directory = Path(directory)
    weights = {k: v.detach().contiguous() for k, v in policy.network.state_dict().items()}
    atomic_torch_save(directory / WEIGHTS_FILE, weights)
    with warnings.catch_warnings():  # torch 2.13 deprecates torch.jit; the file is still what libtorch loads
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(_ScriptedGreedy(policy.network))

        def save(tmp: Path) -> None:  # through a handle: no temporary file name inside the archive
            with open(tmp, "wb") as handle:
                torch.jit.save(scripted, handle)

        atomic_write(directory / TORCHSCRIPT_FILE, save)
    spec = {
        "format": POLICY_FORMAT,
        "version": POLICY_VERSION,
        "kind": policy.kind,
        "architecture": policy.architecture(),
        "env_id": env_id,
        "observation_space": space_to_dict(observation_space),
        "action_space": _with_labels(space_to_dict(action_space), action_labels),
        "privacy": dict(privacy) if privacy is not None else None,
        "files": {"weights": WEIGHTS_FILE, "torchscript": TORCHSCRIPT_FILE},
        "sha256": {name: sha256_file(directory / name) for name in (WEIGHTS_FILE, TORCHSCRIPT_FILE)},
        **({"extra": dict(extra)} if extra else {}),
    }
    atomic_write_json(directory / SPEC_FILE, spec)
    return directory


def load_policy(directory: str | Path, map_location: str | torch.device = "cpu") -> GreedyPolicy:
    """A released policy from ``directory`` alone (weights-only; sizes bounded before allocation; hashes checked)."""
    directory = Path(directory)
    if directory.is_file() and directory.name == SPEC_FILE:
        directory = directory.parent
    spec = read_json(directory / SPEC_FILE, "policy")
    if not isinstance(spec, dict) or spec.get("format") != POLICY_FORMAT:
        raise ValidationError("policy", f"{directory / SPEC_FILE} is not a {POLICY_FORMAT} file")
    if spec.get("version") != POLICY_VERSION:
        raise ValidationError("policy.version", f"unsupported version {spec.get('version')!r}")
    kinds = known_kinds()
    if spec.get("kind") not in kinds:
        raise ValidationError("policy.kind", f"unknown policy kind {spec.get('kind')!r} (known: {', '.join(kinds)})")
    if spec.get("env_id") is not None:
        check_no_module("policy.env_id", spec["env_id"])  # a name, never a module to import
    architecture = spec.get("architecture")
    if not isinstance(architecture, dict) or architecture.get("activation", "relu") != "relu":
        raise ValidationError("policy.architecture", f"expected an MLP description, got {architecture!r}")
    policy = GreedyPolicy(architecture.get("obs_dim"), architecture.get("hidden_sizes"), architecture.get("n_actions"),
                          spec, kind=spec["kind"])
    path = directory / WEIGHTS_FILE
    recorded = (spec.get("sha256") or {}).get(WEIGHTS_FILE)
    if recorded is not None and path.is_file() and sha256_file(path) != recorded:
        raise ValidationError("policy.weights", f"{path} does not match the sha256 recorded in {SPEC_FILE}")
    weights = load_weights(path, "policy.weights", map_location)
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise ValidationError("policy.weights", f"{path} is not a state_dict of tensors")
    try:
        policy.network.load_state_dict(weights)
    except RuntimeError as exc:
        raise ValidationError("policy.weights", f"do not match the architecture in {SPEC_FILE}: {str(exc)[:300]}") from None
    for name, tensor in weights.items():
        if not bool(torch.isfinite(tensor).all()):
            raise ValidationError(f"policy.weights.{name}", "contains NaN or inf")
    return policy.to(map_location).eval()
