"""Pipeline "train": train a policy privately from logged data, with any registered algorithm (Sharma et al. 2024,
"Private and robust offline RL with expert-level privacy", over any privacy unit).

    pipeline: train
    algorithm: {name: cql, hidden_sizes: [256, 256]}   # or bc, or any algorithm of dporl.algos.registry
    method: mixed                                      # non_private, dp_sgd, stable_only, mixed (dporl.methods)

``algorithm`` is a registered algorithm and its hyper-parameters (``dporl list`` shows them); ``method`` says how
the privacy mechanisms and the algorithm combine (``dporl.methods.unit_level``): non-private training (no
guarantee), DP-SGD over units (Algorithm 4), the stable-prefix release then noiseless training (Algorithms 1-2), or
Algorithm 3's mixture. Under Algorithm 3 with a fresh release the training stage takes what the release leaves of
the run budget under one joint PLD over both stages, so the run's guarantee meets (eps, delta) instead of about
0.71 eps for a fixed eps - eps1 (the paper's fixed split is kept for the logged variant).

The release (``release.source: fresh``, the default) rolls the experts out in the public simulator of the logging
environment and never reads the logged data, so D_unstable is the whole logged dataset. ``release.source: logged``
is the paper's variant, kept for reproduction: the run prints "the paper's mechanism: NO guarantee" and never a
GUARANTEE line (its figure is shown as a paper claim).

Neighbouring relation (``relation``). ``add_remove`` (the default): D and D' differ by one unit, so the number of
units m is private and the run never uses it: its first spend is a private count m~ (stage "unit_count", a
``count_fraction`` share of the budget, ``dporl.privacy.count``), and every count-dependent quantity is derived
from m~: the Poisson rate B / m~ (DP-SGD still divides by the public B), the calibrated noise and step count, the
stable-prefix precondition (on m~'s lower confidence bound), DP-FQE's normalisers (one count per cell of the
evaluation partition), and refusals (which name m~ as the released estimate). ``replace_one``: D and D' have the
same units, one unit's data replaced; m is public by that definition and is used as is, and every mechanism is
analysed for replace-one neighbours (``dporl.privacy.relations``: DP-SGD and mixture steps by the replace-one PLD,
the stable-prefix runs by group privacy), which the GUARANTEE line states ("replace one unit's data; the number of
units is public").

Privacy unit: the data's (the logging expert with every trajectory it logged, or the column the user named: DP-SGD
is then unit-level DP-SGD over that column's values; the release methods need the queryable experts and a simulator
and refuse data grouped by any other unit). Accounting: the release stage composes T (2 eps', beta) runs by PLD;
the training stage records one event per step as the sampler states it (a ``MixtureEvent`` for Algorithm 3: the
branch taken is observable, so the paper's rate-(p_dp q) figure is recorded as a paper claim, not a guarantee).
Training runs for as many steps as the budget allows (``trainer.max_steps`` caps it; ``dp.noise_multiplier: null``
calibrates sigma for that cap). The guarantee printed at the end is the ledger's.

Data (``data``, ``dporl.pipelines.inputs``): a saved or generated expert dataset (``format: npz``), a CSV / Parquet
table with its column mapping (``format: table``), or a Minari dataset (``format: minari``).

Evaluation (``dporl.pipelines.train.evaluation``): returns of the greedy policy in the public simulator, or, without
one, a private evaluation on held-out units in the same ledger, composed in parallel.

Run directory (``dporl.train.run_dir``): ``RUN/release/`` receives what the guarantee covers (the greedy policy in
``policy/``, D_stable, the release's public parameters, the privacy report, the public summary and public
TensorBoard scalars); ``RUN/curator/`` everything else. All secret randomness of a run comes from one
``SecretRoot`` (``noise_seed``, else 256 bits from the OS CSPRNG): streams "unit_count/noise",
"release/expert_choice", "release/env", "release/actions", "release/laplace", "train/sampler", "train/noise". The
whole run has the budget (``epsilon``, ``delta``): the ledger refuses any stage or state that would take the
guarantee past it.

Modules: ``config`` (the typed configuration), ``data`` (loading and generating the logged data), ``planning``
(every refusal before the first write, the count-dependent checks, the calibration), ``release`` (the stable-prefix
release, paid once), ``evaluation`` (simulator or private offline evaluation), ``runners`` (the run and its stages),
``report`` (what the run releases and prints).
"""

from __future__ import annotations

from dporl.pipelines import Pipeline
from dporl.pipelines.train.config import (
    PIPELINE_NAME,
    RELEASE_STAGE,
    TRAIN_STAGE,
    EvalConfig,
    PrivateTrainingConfig,
    TrainPipelineConfig,
)
from dporl.pipelines.train.data import check_generation, generate_dataset, load_data
from dporl.pipelines.train.evaluation import simulator_id, training_plan
from dporl.pipelines.train.planning import training_noise
from dporl.pipelines.train.runners import run

PIPELINE = Pipeline(PIPELINE_NAME, TrainPipelineConfig, run)

__all__ = ["EvalConfig", "PIPELINE", "PIPELINE_NAME", "PrivateTrainingConfig", "RELEASE_STAGE", "TRAIN_STAGE",
           "TrainPipelineConfig", "check_generation", "generate_dataset", "load_data", "run", "simulator_id",
           "training_noise", "training_plan"]
