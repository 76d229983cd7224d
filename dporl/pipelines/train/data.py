"""The logged data of a "train" run: a saved or generated expert dataset (``data.format: npz``) and the expert set
that logged it, when the method needs it. Generation runs the "dataset" pipeline once into its out_dir (reused when
it holds this very generation, refused when it holds another: logged data are never overwritten by a changed
config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from dporl.data.dataset import TrajectoryDataset
from dporl.experts.expert_set import ExpertSet
from dporl.pipelines import get_pipeline
from dporl.pipelines.inputs import DataConfig
from dporl.train.run_dir import RunDirectory
from dporl.utils.config import from_dict, to_dict
from dporl.utils.validation import ValidationError


def dataset_config(generate: dict[str, Any], out_dir: Optional[str | Path] = None):
    """The "dataset" pipeline config of ``generate`` (validated: errors are named before anything is written)."""
    generator = get_pipeline("dataset")
    data = {"pipeline": "dataset", **generate}
    if out_dir is not None and "out_dir" not in generate:
        data["out_dir"] = str(out_dir)
    return generator, from_dict(generator.config_cls, data)


def check_generation(generate: dict[str, Any], out_dir: Optional[str | Path] = None, replaced: Optional[Path] = None) -> None:
    """Refuse, writing nothing, a generation whose config is invalid or whose out_dir holds another generation
    (unless that out_dir lies inside ``replaced``, a run directory --overwrite is about to remove)."""
    try:
        _, config = dataset_config(generate, out_dir)
    except ValidationError as exc:  # named as the run's config says it: data.generate.<field>
        raise type(exc)(f"data.generate.{exc.field}", str(exc).split(": ", 1)[-1]) from None
    if replaced is not None and Path(config.out_dir).resolve().is_relative_to(replaced.resolve()):
        return
    try:
        RunDirectory(config.out_dir, pipeline="dataset", config=to_dict(config), mode="resume",
                     curator_only=True).close()
    except ValidationError as exc:
        if exc.field != "run_dir":
            raise
        raise ValidationError("data.generate.out_dir", str(exc).split(": ", 1)[1]) from None


def generate_dataset(generate: dict[str, Any], out_dir: Optional[str | Path] = None) -> tuple[str, str]:
    """Run the "dataset" pipeline with config ``generate``; (dataset path, expert set path).

    Its out_dir (``generate.out_dir``, else ``out_dir``) is reused when it holds this very generation (same config)
    and refused when it holds another one: logged data are never overwritten by a changed config.
    """
    check_generation(generate, out_dir)
    generator, config = dataset_config(generate, out_dir)
    outputs = generator.run(config, mode="resume")
    return outputs["dataset"], outputs["expert_set"]


def load_data(
    config: DataConfig, out_dir: Optional[str | Path] = None, need_experts: bool = True
) -> tuple[TrajectoryDataset, Optional[ExpertSet]]:
    """The logged dataset and, when asked for and known, the expert set that logged it (``out_dir``: where a
    generated dataset goes when ``generate`` names no out_dir)."""
    if config.generate is not None:
        dataset_path, expert_path = generate_dataset(config.generate, out_dir)
        expert_path = config.expert_set or expert_path
    else:
        dataset_path, expert_path = config.npz_path, config.expert_set
    dataset = TrajectoryDataset.load(dataset_path, mmap=config.mmap)
    if not need_experts:
        return dataset, None
    if expert_path is None:
        expert_path = (dataset.metadata.expert_set or {}).get("path")
    experts = ExpertSet.load(expert_path) if expert_path is not None else None
    return dataset, experts
