"""Pipeline "fnq": reward-level private Q-learning (privacy unit "reward", sup |r - r'| <= 1) and its baselines.

Methods (``dporl.methods.reward_level``; learners in ``dporl.algos.fnq``, ``dporl.algos.fnq_baselines``):

* ``fnq``: dporl's sound mechanism, public-iterate Gaussian updates (``RewardPrivateQLearning``): per-transition
  Jacobians clipped to ``clip_norm`` G, TD errors clipped to ``td_clip``, N(0, (z G s)^2) on every mean update,
  U updates accounted as U Gaussian events through the Trainer and the ledger (GUARANTEE). ``noise_multiplier`` z
  given: the run stops when the budget is spent (at most U = ``updates``); not given: z is calibrated for U.
  The GP paths (``exploration_sigma``) are exploration only; any optimizer is post-processing.
* ``input_perturbation``: Gaussian noise on every reward once (N = all logged rewards offline, the T environment
  steps online), then the same learner without noise (GUARANTEE, one Gaussian event of sensitivity sqrt(N)).
* ``dp_sgd``: the paper's DP-SGD baseline (whole batch one unit, GUARANTEE).
* ``fnq_paper``: the paper's Algorithm 1 with Theorem 5's sigma (1-D states, plain SGD). Theorem 5 does not cover
  what it releases: its (eps, delta) is printed as "the paper's figure, NOT a guarantee" and the run reports NO
  GUARANTEE.
* ``non_private``: ``RewardPrivateQLearning`` without clipping or noise; ``random_policy`` and ``untrained`` (greedy on
  the initial network) are data-free rows, so that "learns" means something.

Two kinds of experiment, both over ``seeds``:

* Sweep (``epsilons`` empty): the paper's mechanism (``fnq_paper``) for every path scale in ``sigmas`` and reset
  factor J in ``reset_factors`` (paths reset every U / J updates), uncalibrated: no epsilon (NO GUARANTEE).
* Comparison (``epsilons`` given): every method in ``methods`` at each epsilon and total ``delta``; ``non_private``
  and the data-free rows run once. The table gives the final return with a 95% Student-t interval over seeds and,
  per certified method, the smallest epsilon of the grid reaching 90% of the non-private return (and 90% of its
  gain over the best data-free row).

Data: online (``env_id``: ``samples`` environment steps, ``env_steps_per_update`` new transitions per update, optional
replay) or offline (``dataset``: ``samples / batch_size`` updates of uniform minibatches of logged transitions).

Randomness: one ``SecretRoot`` per pipeline invocation (``noise_seed``, else 256 bits of OS entropy) derives one
root per run ("<label>/seed<k>/root"), whose named streams serve every mechanism of that run: the Trainer's
"train/sampler" and "train/noise", and "paths" (GP paths), "env" (episode seeds, exploration coins),
"reward_noise" (input perturbation), "release_paths" (future draws of the released paths). Network initialisation
and evaluation episodes use the public seed.

Evaluation returns in the environment are computed from the protected reward function itself: they are curator-only
(the Trainer keeps them out of ``release/``; ``results.json``, ``table.md`` and the PNGs go to ``run_dir/curator``)
and never part of a release. Each (method, seed) is a Trainer run directory ``run_dir/<label>/seed<k>`` whose
``release/released.pt`` is the released Q-network with its paths.

Modules: ``config`` (the typed configuration and the runs it plans), ``runners`` (one run per (method, seed): the
method's mechanism, its learner and source, the Trainer), ``report`` (rows, table, plots).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dporl.envs.registry import make_vec
from dporl.pipelines import Pipeline, curator_note
from dporl.pipelines.fnq.config import FNQPipelineConfig, RunSpec, plan, theorem5_calibration
from dporl.pipelines.fnq.report import epsilon_to_reach, plots, summarise, table
from dporl.pipelines.fnq.runners import PIPELINE_NAME, context, dataset_of, train_one
from dporl.pipelines.inputs import check_inputs_outside
from dporl.train.run_dir import RunDirectory, RunMode
from dporl.utils.config import from_dict, to_dict
from dporl.utils.io import atomic_write_json, atomic_write_text
from dporl.utils.validation import ValidationError


def run(config: FNQPipelineConfig, mode: RunMode = "new") -> dict:
    with RunDirectory(config.run_dir, pipeline=PIPELINE_NAME, config=to_dict(config), mode=mode) as directory:
        check_inputs_outside(directory, {"dataset": config.dataset})  # --overwrite keeps the user's input
        return _run(config, directory)


def _run(config: FNQPipelineConfig, directory: RunDirectory) -> dict:
    from tqdm.auto import tqdm

    torch.set_num_threads(1)
    specs = plan(config)
    ctx = context(config)
    if config.dataset is not None:  # declared sizes (public) must match the environment's before anything runs
        meta = dataset_of(config).metadata
        if (meta.n_actions, int(np.prod(meta.obs_shape))) != (ctx.n_actions, ctx.obs_dim):
            raise ValidationError("dataset.metadata.n_actions", f"the dataset declares {meta.n_actions} actions and "
                                  f"{meta.obs_shape} observations; {config.env_id} has {ctx.n_actions} and "
                                  f"{ctx.obs_dim}")
    for spec in specs:  # calibrations (and their refusals) before the first write
        if spec.spec.paper and spec.epsilon is not None:
            if ctx.obs_dim != 1:
                raise ValidationError("epsilons", "Theorem 5 is stated for one-dimensional states; run a sweep instead")
            theorem5_calibration(config, spec)
    directory.begin()  # each (method, seed) below is a Trainer run directory of its own under run_dir
    runs = []
    for spec, seed in tqdm([(s, k) for s in specs for k in config.seeds], desc="fnq runs", disable=not config.progress):
        runs.append(train_one(config, spec, seed, ctx))
    rows = summarise(runs)
    # Under reward-level privacy the returns are computed from the protected rewards: curator-only (files under
    # curator/ and a labelled stderr note). What returns to the command line is public: each run's guarantee.
    out_dir = directory.curator
    text = table(rows)
    atomic_write_text(out_dir / "table.md", text)
    plots(config, rows, out_dir)
    atomic_write_json(out_dir / "results.json", {"config": to_dict(config), "rows": rows, "runs": runs,
                                                 "epsilon_to_reach_90": epsilon_to_reach(rows)})
    curator_note(f"returns computed from the protected reward function, in {out_dir / 'table.md'}:\n{text}")
    guarantees = {row["label"]: row["guarantee"] for row in rows}
    return {"pipeline": PIPELINE_NAME, "runs": len(runs), "curator_results": str(out_dir / "results.json"),
            "guarantees": guarantees, "headline": {f"{label} (privacy unit: reward)": guarantee
                                                  for label, guarantee in guarantees.items()}}


def evaluate(payload: dict, *, episodes: int, seed: int, out_dir: str | Path) -> dict:
    """evaluate.py: play the run's released function (``released.pt`` beside its checkpoints) greedily.

    The returns use the environment's rewards: curator-only under reward-level privacy."""
    from dporl.algos.fnq import load_noisy_q
    from dporl.eval.returns import evaluate_returns

    config = from_dict(FNQPipelineConfig, {k: v for k, v in payload["config"].items() if k != "run"})
    released = Path(out_dir) / "release" / "released.pt"
    if not released.exists():
        raise ValidationError("checkpoint", f"no released function at {released}")
    function, metadata = load_noisy_q(released)
    env = make_vec("env_id", config.env_id, num_envs=min(episodes, 16), vectorization_mode="sync")
    stats = evaluate_returns(function.act, env, episodes, seed)
    env.close()
    metrics = {**stats.to_dict(), "label": metadata.get("label"), "privacy": metadata.get("privacy"),
               "note": "curator-only: computed from the protected reward function"}
    atomic_write_json(Path(out_dir) / "eval.json", metrics)
    return metrics


PIPELINE = Pipeline(PIPELINE_NAME, FNQPipelineConfig, run, evaluate)


__all__ = ["FNQPipelineConfig", "PIPELINE", "RunSpec", "context", "evaluate", "plan", "run", "theorem5_calibration",
           "train_one"]
