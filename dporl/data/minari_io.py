"""Minari interop: read a LOCAL Minari dataset into a ``TrajectoryDataset`` and write one back (no jax needed).

Minari episodes have ``L + 1`` observations and ``L + 1`` info entries (entry 0 from ``reset``, entry ``t + 1``
from the step that took action ``a_t``). dporl stores its per-episode fields in the infos:

    expert_id          [L+1] int64, constant over the episode (the privacy unit: which expert logged it)
    start_step         [L+1] int64, constant (time index of the first transition; only written when some episode
                       is a fragment, 0 when absent)
    behavior_log_prob  [L+1] float32, entry t+1 = log pi_b(a_t | s_t), entry 0 = NaN (reset has no action)

and the full ``DatasetMetadata`` as JSON under the Minari metadata key ``dporl_metadata``, so an export followed by
an import returns the same dataset. Datasets written by other tools name their expert id key (``expert_id_key``)
or come with a mapping episode id -> expert id; their metadata is derived from the Minari spaces. The action set is
always a declaration, never read from the episodes: the stored dporl metadata's ``n_actions`` (declared when the
data were imported or logged) or the dataset's ``Discrete(n)`` action space (its schema); an action outside it is
refused when the dataset is read, before any run starts.

Minari datasets live under a root directory (``root=``, else ``$MINARI_DATASETS_PATH``, else ``~/.minari/datasets``).
An export is built in a temporary root beside the target and moved into place with one directory rename, so a
failed export leaves nothing behind and readers never see a half-written dataset.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import numpy as np
from tqdm import tqdm

from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.data.metadata import VERSION_2_KEYS
from dporl.envs.registry import check_no_module
from dporl.utils.io import dump_json, parse_json, read_json
from dporl.utils.validation import ValidationError

try:
    import gymnasium as gym
    import minari
    from minari.data_collector.episode_buffer import EpisodeBuffer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("Minari interop needs the minari extra: pip install 'dporl[minari]'") from exc

DPORL_METADATA_KEY = "dporl_metadata"
EXPERT_ID_INFO = "expert_id"
START_STEP_INFO = "start_step"
BEHAVIOR_LOG_PROB_INFO = "behavior_log_prob"
# Minari writes one HDF5 group per episode (milliseconds each); episodes go in chunks so progress can be shown.
_WRITE_CHUNK = 256


@contextlib.contextmanager
def _minari_root(root: Path) -> Iterator[None]:
    """Point Minari (which reads its root from the environment on every call) at ``root`` for a while.

    The environment is process-wide: do not run exports/imports concurrently in threads of one process.
    """
    previous = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = str(root)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["MINARI_DATASETS_PATH"]
        else:
            os.environ["MINARI_DATASETS_PATH"] = previous


def _resolve_root(root: Optional[str | os.PathLike]) -> Path:
    if root is not None:
        path = Path(root)
        path.mkdir(parents=True, exist_ok=True)
        return path
    from minari.storage import get_dataset_path

    return Path(get_dataset_path())  # honours $MINARI_DATASETS_PATH, creates the default root if needed


def _parse_id(dataset_id: Any, field_name: str = "dataset_id") -> Optional[str]:
    """The namespace of a well-formed Minari id (``(namespace/)name-v<version>``)."""
    from minari.dataset.minari_dataset import parse_dataset_id

    if not isinstance(dataset_id, str):
        raise ValidationError(field_name, f"expected a string, got {dataset_id!r}")
    try:
        return parse_dataset_id(dataset_id)[0]
    except ValueError as exc:
        raise ValidationError(field_name, f"neither a Minari dataset directory nor a valid id: {exc}") from None


# ---------------------------------------------------------------------------------------------------- export
def export_minari(
    dataset: TrajectoryDataset,
    dataset_id: str,
    *,
    root: Optional[str | os.PathLike] = None,
    env: Optional[str | gym.envs.registration.EnvSpec] = None,
    algorithm_name: str = "dporl",
    author: Optional[str] = None,
    author_email: Optional[str] = None,
    code_permalink: Optional[str] = None,
    description: Optional[str] = None,
    progress: bool = True,
) -> "minari.MinariDataset":
    """Write ``dataset`` as the local Minari dataset ``dataset_id`` (which must not exist yet) and open it.

    ``env`` (a registered id or spec) is recorded so Minari users can ``recover_environment()``; the spaces are
    always ``Box(-inf, inf, obs_shape, float32)`` and ``Discrete(n_actions)``, which is what the data guarantees.
    """
    if not isinstance(dataset, TrajectoryDataset):
        raise ValidationError("dataset", f"expected a TrajectoryDataset, got {type(dataset).__name__}")
    namespace = _parse_id(dataset_id)
    final_root = _resolve_root(root)
    target = final_root / dataset_id
    if target.exists():
        raise ValidationError("dataset_id", f"a Minari dataset already exists at {target}; choose another id/version")
    meta = dataset.metadata
    observation_space = gym.spaces.Box(-np.inf, np.inf, shape=meta.obs_shape, dtype=np.float32)
    action_space = gym.spaces.Discrete(meta.n_actions)
    if description is None:
        description = (
            f"dporl TrajectoryDataset: {dataset.n_episodes} episodes of {meta.env_id} logged by "
            f"{meta.n_units} experts; infos carry '{EXPERT_ID_INFO}' (the privacy unit)"
        )
    buffers = _episode_buffers(dataset)
    bar = tqdm(total=len(buffers), desc=f"export {dataset_id}", unit="episode", disable=not progress)
    staging = Path(tempfile.mkdtemp(prefix=".dporl-export-", dir=final_root))
    try:
        with _minari_root(staging):
            written = minari.create_dataset_from_buffers(
                dataset_id,
                buffers[:_WRITE_CHUNK],
                env=env,
                algorithm_name=algorithm_name,
                author=author,
                author_email=author_email,
                code_permalink=code_permalink,
                description=description,
                observation_space=observation_space,
                action_space=action_space,
            )
            bar.update(min(len(buffers), _WRITE_CHUNK))
            for start in range(_WRITE_CHUNK, len(buffers), _WRITE_CHUNK):
                written.storage.update_episodes(buffers[start : start + _WRITE_CHUNK])
                bar.update(len(buffers[start : start + _WRITE_CHUNK]))
            written.storage.update_metadata({DPORL_METADATA_KEY: dump_json(meta.to_dict(), sort_keys=True)})
        if namespace is not None:
            with _minari_root(final_root):
                from minari.namespace import create_namespace, list_local_namespaces

                if namespace not in list_local_namespaces():
                    create_namespace(namespace)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staging / dataset_id, target)  # one rename: the dataset appears complete or not at all
    finally:
        bar.close()
        shutil.rmtree(staging, ignore_errors=True)
    return minari.MinariDataset(target / "data")


def _episode_buffers(dataset: TrajectoryDataset) -> list:
    """One EpisodeBuffer per episode; the arrays are views of split flat storage (Minari's API is per episode)."""
    lengths = dataset.episode_lengths
    cut_transitions = np.cumsum(lengths)[:-1]
    cut_observations = cut_transitions + np.arange(1, dataset.n_episodes)

    def split(values: np.ndarray, cuts: np.ndarray) -> list:
        return np.split(values, cuts) if dataset.n_episodes else []

    observations = split(dataset.observations, cut_observations)
    actions = split(dataset.actions, cut_transitions)
    rewards = split(dataset.rewards, cut_transitions)
    terminations = split(dataset.terminations, cut_transitions)
    truncations = split(dataset.truncations, cut_transitions)
    log_probs = None
    if dataset.behavior_log_probs is not None:
        log_probs = split(dataset.behavior_log_probs, cut_transitions)
    # start steps are written only when some episode is a fragment (each info is one more HDF5 dataset per episode)
    with_start_steps = bool(np.any(dataset.start_steps))
    buffers = []
    for e in range(dataset.n_episodes):
        infos = {EXPERT_ID_INFO: np.full(lengths[e] + 1, dataset.unit_ids[e], dtype=np.int64)}
        if with_start_steps:
            infos[START_STEP_INFO] = np.full(lengths[e] + 1, dataset.start_steps[e], dtype=np.int64)
        if log_probs is not None:
            infos[BEHAVIOR_LOG_PROB_INFO] = np.concatenate([[np.nan], log_probs[e]]).astype(np.float32)
        buffers.append(
            EpisodeBuffer(
                observations=observations[e],
                actions=actions[e],
                rewards=rewards[e],
                terminations=terminations[e],
                truncations=truncations[e],
                infos=infos,
            )
        )
    return buffers


# ---------------------------------------------------------------------------------------------------- import
def import_minari(
    source: str | os.PathLike,
    expert_id_key: str | Mapping[int, int] = EXPERT_ID_INFO,
    *,
    root: Optional[str | os.PathLike] = None,
    n_units: Optional[int] = None,
    metadata: Optional[DatasetMetadata] = None,
    behavior_log_prob_key: Optional[str] = BEHAVIOR_LOG_PROB_INFO,
    progress: bool = True,
) -> TrajectoryDataset:
    """Read a local Minari dataset (an id under ``root``, or the path of a dataset / its ``data`` directory).

    ``expert_id_key``: the info key holding each episode's expert id (constant over the episode), or a mapping
    Minari episode id -> expert id covering every episode. Metadata comes from ``metadata=``, else from a dporl
    export's stored metadata, else from the Minari spaces with ``n_units`` (default: largest id + 1).
    ``behavior_log_prob_key`` (None to skip): info key of behaviour log-probabilities, step-aligned as above.
    """
    data = _open(source, root)
    _check_declared_size(data)
    indices = data.episode_indices
    reader = data.storage.get_episodes(indices)  # a generator: one HDF5 read per episode
    # The bar shows a percentage only: the number of episodes is private (it reaches the curator's stderr anyway).
    episodes = list(tqdm(reader, total=len(indices), desc="import Minari", disable=not progress,
                         bar_format="{desc}: {percentage:3.0f}%|{bar}|"))
    stored = data.storage.metadata.get(DPORL_METADATA_KEY)
    if metadata is None and stored is not None:
        if n_units is not None:
            raise ValidationError("n_units", "the dataset carries dporl metadata; pass metadata= to override it")
        payload = parse_json(stored, DPORL_METADATA_KEY)  # an export by a dporl of dataset format 2 has n_experts
        version = 2 if isinstance(payload, dict) and any(key in payload for key in VERSION_2_KEYS) else 3
        metadata = DatasetMetadata.from_dict(payload, version)
    unit_ids = _expert_ids(episodes, expert_id_key)
    if metadata is None:
        metadata = _derived_metadata(data, unit_ids, n_units)
    elif n_units is not None:
        raise ValidationError("n_units", "give either metadata= or n_units=, not both")
    lengths = np.array([len(ep["actions"]) for ep in episodes], dtype=np.int64)
    for field_name in ("observations", "actions"):
        for i, ep in enumerate(episodes):
            if not isinstance(ep[field_name], np.ndarray):
                raise ValidationError(
                    f"episodes[{i}].{field_name}", f"expected an array (dict/tuple spaces are not supported), "
                    f"got {type(ep[field_name]).__name__}"
                )

    def cat(key: str, empty_shape: tuple = (0,)) -> np.ndarray:
        return np.concatenate([np.asarray(ep[key]) for ep in episodes]) if episodes else np.zeros(empty_shape)

    return TrajectoryDataset(
        observations=cat("observations", (0, *metadata.obs_shape)).astype(np.float32),
        actions=cat("actions").astype(np.int64),
        rewards=cat("rewards"),
        terminations=cat("terminations").astype(bool),
        truncations=cat("truncations").astype(bool),
        episode_lengths=lengths,
        unit_ids=unit_ids,
        start_steps=_constant_info(episodes, START_STEP_INFO, required=False),
        behavior_log_probs=_step_info(episodes, behavior_log_prob_key),
        metadata=metadata,
    )


def _open(source: str | os.PathLike, root: Optional[str | os.PathLike]) -> "minari.MinariDataset":
    path = Path(source)
    candidates = [path / "data", path] if path.is_dir() else []
    if not candidates:
        _parse_id(str(source), "source")
        candidates = [_resolve_root(root) / str(source) / "data"]
    for data_path in candidates:
        if (data_path / "metadata.json").is_file():
            _check_minari_metadata(data_path / "metadata.json")
            try:
                return minari.MinariDataset(data_path)
            except Exception as exc:  # Minari raises assorted errors for broken storage
                raise ValidationError("source", f"cannot open Minari dataset at {data_path}: {exc}") from exc
    raise ValidationError("source", f"no local Minari dataset at {candidates[0].parent}")


def _check_minari_metadata(path: Path) -> None:
    """Refuse, before Minari reads it, a ``metadata.json`` that would make Minari build an environment.

    Minari recovers missing observation / action spaces by ``gym.make`` of the stored env spec, whose entry point
    is a "module:Class" string from the file: that would import and run code named by the file. dporl reads only
    datasets that declare both spaces, and an env spec's id must name no module (``dporl.envs.registry``).
    """
    metadata = read_json(path, "source.metadata")
    if not isinstance(metadata, dict):
        raise ValidationError("source.metadata", f"{path} is not a JSON object")
    for key in ("observation_space", "action_space"):
        if not isinstance(metadata.get(key), str):
            raise ValidationError(
                f"source.metadata.{key}", f"{path} does not declare the {key.replace('_', ' ')}; Minari would recover "
                "it by making the environment its env spec names (importing code the file chooses): refused")
    for key in ("env_spec", "eval_env_spec"):
        spec = metadata.get(key)
        if spec is None:
            continue
        parsed = parse_json(spec, f"source.metadata.{key}", str(path)) if isinstance(spec, str) else None
        if not isinstance(parsed, dict):
            raise ValidationError(f"source.metadata.{key}", f"{path}: expected a JSON object string")
        check_no_module(f"source.metadata.{key}.id", parsed.get("id"))


def _check_declared_size(data: "minari.MinariDataset") -> None:
    """Bound an import by what the dataset declares before any episode is read: its steps and episodes times the
    bytes each takes in memory (observations of the declared space, action, reward, two flags, the infos' ids)."""
    from dporl.utils.archives import load_budget_bytes

    steps, episodes = int(data.total_steps), int(data.total_episodes)
    space = data.observation_space
    per_observation = int(np.prod(getattr(space, "shape", None) or (1,))) * 8
    total = (steps + episodes) * (per_observation + 3 * 8) + steps * (8 + 8 + 2)
    budget = load_budget_bytes()
    if steps < 0 or episodes < 0 or total > budget:
        raise ValidationError("source", f"the dataset declares {steps} steps in {episodes} episodes ({total} bytes to "
                              f"import), more than the {budget} this machine may load (half its memory)")


def _derived_metadata(
    data: "minari.MinariDataset", unit_ids: np.ndarray, n_units: Optional[int]
) -> DatasetMetadata:
    action_space, observation_space = data.action_space, data.observation_space
    if not isinstance(action_space, gym.spaces.Discrete) or int(action_space.start) != 0:
        raise ValidationError("action_space", f"dporl needs Discrete(n) actions starting at 0, got {action_space}")
    if not isinstance(observation_space, gym.spaces.Box):
        raise ValidationError("observation_space", f"dporl needs a Box observation space, got {observation_space}")
    if n_units is None:
        n_units = int(unit_ids.max()) + 1 if len(unit_ids) else 1
    env_spec = data.env_spec
    return DatasetMetadata(
        env_id=env_spec.id if env_spec is not None else data.spec.dataset_id,
        n_actions=int(action_space.n),
        n_units=n_units,
        obs_shape=tuple(observation_space.shape),
        extra={"minari_dataset_id": data.spec.dataset_id, "minari_version": data.spec.minari_version},
    )


def _expert_ids(episodes: list, expert_id_key: str | Mapping[int, int]) -> np.ndarray:
    if isinstance(expert_id_key, str):
        return _constant_info(episodes, expert_id_key, required=True)
    if not isinstance(expert_id_key, Mapping):
        raise ValidationError("expert_id_key", f"expected an info key or a mapping, got {type(expert_id_key).__name__}")
    missing = [int(ep["id"]) for ep in episodes if int(ep["id"]) not in expert_id_key]
    if missing:
        raise ValidationError("expert_id_key", f"no expert for Minari episode(s) {missing[:5]} ({len(missing)} in all)")
    return np.array([expert_id_key[int(ep["id"])] for ep in episodes], dtype=np.int64)


def _info(ep: Mapping, key: str) -> Optional[np.ndarray]:
    infos = ep.get("infos") or {}
    return None if key not in infos else np.asarray(infos[key])


def _constant_info(episodes: list, key: str, *, required: bool) -> Optional[np.ndarray]:
    """One integer per episode from an info that must hold the same integer at every step."""
    present = [_info(ep, key) is not None for ep in episodes]
    if not any(present) and not required:
        return None
    values = np.zeros(len(episodes), dtype=np.int64)
    for i, ep in enumerate(episodes):
        value = _info(ep, key)
        if value is None:
            raise ValidationError(f"infos.{key}", f"missing in episode {int(ep['id'])}")
        if value.dtype.kind not in "iu" or value.ndim != 1 or len(value) == 0 or np.any(value != value[0]):
            raise ValidationError(
                f"infos.{key}", f"episode {int(ep['id'])}: expected one integer repeated at every step, got {value!r}"
            )
        values[i] = value[0]
    return values


def _step_info(episodes: list, key: Optional[str]) -> Optional[np.ndarray]:
    """Per-transition values from a step-aligned info (entry t+1 belongs to transition t), all or none."""
    if key is None or not episodes:
        return None
    present = [_info(ep, key) is not None for ep in episodes]
    if not any(present):
        return None
    if not all(present):
        raise ValidationError(f"infos.{key}", f"missing in episode {int(episodes[present.index(False)]['id'])}")
    parts = []
    for ep in episodes:
        value = _info(ep, key)
        if value.shape != (len(ep["actions"]) + 1,):
            raise ValidationError(
                f"infos.{key}",
                f"episode {int(ep['id'])}: expected shape ({len(ep['actions']) + 1},), got {value.shape}",
            )
        parts.append(value[1:])
    return np.concatenate(parts)
