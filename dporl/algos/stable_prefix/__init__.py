"""Stable-prefix release (expert-level paper, Algorithms 1-2): sparse-vector filtering of FRESH rollouts.

Privacy unit: one expert (add/remove an expert with its policy and all its trajectories). Each of the T runs:

1. picks an expert i uniformly at random (secret stream ``release/expert_choice``);
2. rolls out expert i's p_min-softened policy in the PUBLIC simulator of the logging environment (the dataset's
   ``env_id`` with the physics and make arguments its metadata records), from a fresh initial state, with fresh
   environment randomness (a secret Gymnasium reset seed, ``release/env``) and fresh action sampling
   (``release/actions``), up to the horizon H;
3. draws its noisy threshold G_hat = G + Lap(b) once, b = 2 / eps' (monotone queries; 4 / eps' otherwise), and at
   step k (state s_k, action a_k sampled from expert i) answers q_k = sum_i prod_{t<=k} pi_i(a_t | s_t) with fresh
   Lap(b) noise (``release/laplace``): pass -> the simulator steps to (r_k, s_{k+1}); fail -> the run stops;
4. releases its longest passing prefix (s_1, a_1, r_1, ..., s_K, a_K, r_K, s_{K+1}) into D_stable (possibly none).
   A run also stops when the simulator terminates or truncates (the prefix keeps that flag) or at H.

This is the model of Lemma 5.1 ("a uniformly chosen expert GENERATES the prefix when interacting with the MDP"),
so each run is (2 eps', beta)-DP with G = G0 / p_min + t_beta (``dporl.privacy.sparse_vector``); the ledger stage
``"release"`` composes the T runs by PLD. The logged dataset is never read (only its public metadata): D_unstable,
what private training sees, is the whole logged dataset.

The paper's variant (``source="logged"``) walks LOGGED trajectories instead (expert uniform, then one of its unused
logged episodes). On a fixed dataset that is not private: a logged prefix carries states that exist only because
that expert logged them, so "D_stable holds one of expert j's logged rows" has probability 0 without j and about
T / m with j (``dporl.audit.stable_prefix_audit`` refutes it). It is kept to reproduce the paper's numbers; a run
that uses it has NO guarantee (``PrivacyLedger.void``) and shows the paper's figure only as a paper claim.

Laziness. The T runs advance in lockstep as one vector environment: step k shows the state s_k of every run still
alive to all m experts (in expert chunks to bound memory) in ONE batched query, samples each run's action from its
own expert's row of that query, and advances q_k from the same log-probabilities. Nothing past a run's first failed
query is evaluated: a release costs (states reached) x m expert evaluations, i.e. the bare batched forward passes
plus O(m n n_A) bookkeeping (``benchmarks/bench_stable_prefix.py``).

q_k is accumulated in log space (log q_k = logsumexp_i sum_{t<=k} log pi_i(a_t | s_t), float64) and exponentiated
only for the comparison; noise and threshold live in linear space (the sensitivity-1 statement is about q_k).

Released output. D_stable holds the prefixes only: states, actions, the simulator's rewards and end flags; every
expert id is 0 (a one-expert pool), no behaviour log-probabilities, no reference to the expert set. Which expert each
run followed is secret randomness of the mechanism and stays with the curator (``StablePrefixRelease.curator``).

Modules: ``plan`` (configuration, refusals, accounting), ``rollout`` (the T runs, fresh or logged), ``prefix`` (the
stability queries), ``release`` (D_stable and what is published); the simulator is ``dporl.envs.simulator``.
"""

from dporl.algos.stable_prefix.plan import (
    FRESH_ANALYSIS,
    LOGGED_NO_GUARANTEE,
    RELEASE_STAGE,
    REPLACE_ONE_ANALYSIS,
    STREAMS,
    ReleasePlan,
    ReleaseSource,
    StablePrefixConfig,
    account,
    accounting_plan,
    check_precondition,
    check_release_preconditions,
    plan_release,
    public_simulator,
    stability_floor,
    with_budget,
)
from dporl.algos.stable_prefix.prefix import stability_log_queries, stable_prefix_lengths
from dporl.algos.stable_prefix.release import StablePrefixRelease, public_metadata, release_stable_prefixes
from dporl.algos.stable_prefix.rollout import ReleaseRuns, execute_release
from dporl.envs.simulator import PublicSimulator

__all__ = [
    "FRESH_ANALYSIS", "LOGGED_NO_GUARANTEE", "RELEASE_STAGE", "REPLACE_ONE_ANALYSIS", "STREAMS", "PublicSimulator",
    "ReleasePlan", "ReleaseRuns", "ReleaseSource", "StablePrefixConfig", "StablePrefixRelease", "account",
    "accounting_plan", "check_precondition", "check_release_preconditions", "execute_release", "plan_release",
    "public_metadata", "public_simulator", "release_stable_prefixes", "stability_floor", "stability_log_queries",
    "stable_prefix_lengths", "with_budget",
]
