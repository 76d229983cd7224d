"""The stability queries of a stable-prefix release: q_k = sum_i prod_{t<=k} pi_i(a_t | s_t) over every expert,
advanced one step at a time in log space and compared with the noisy threshold (see ``dporl.algos.stable_prefix``)."""

from __future__ import annotations

import numpy as np
import torch

from dporl.experts.expert_set import ExpertSet
from dporl.privacy.noise import NoiseSource
from dporl.privacy.sparse_vector import StablePrefixBudget


def _expert_log_probs(expert_set: ExpertSet, states: torch.Tensor, chunk: int) -> torch.Tensor:
    """log pi_i(. | s) of every expert on ``states`` [n, d]: [m, n, n_A], evaluated in expert chunks. A distribution
    below p_min is repaired, never refused: the release runs inside a private run (``dporl.experts.expert_set``)."""
    m = expert_set.n_experts
    if chunk >= m:
        return expert_set.log_probs(states, repair=True)
    return torch.cat([expert_set.log_probs(states, experts=slice(s, min(s + chunk, m)), repair=True)
                      for s in range(0, m, chunk)])


def stable_prefix_lengths(
    padded,
    expert_set: ExpertSet,
    noisy_threshold: torch.Tensor,
    budget: StablePrefixBudget,
    noise: NoiseSource,
    expert_chunk: int,
) -> tuple[np.ndarray, int, torch.Tensor]:
    """(released prefix length, states evaluated, released log-mass [m, n]) of each padded logged episode, all
    advancing one step at a time (logged variant)."""
    device = next(expert_set.parameters()).device
    observations = padded.observations.to(device)
    actions = padded.actions.to(device)
    episode_lengths = padded.lengths.to(device)
    n = len(episode_lengths)
    log_mass = torch.zeros(expert_set.n_experts, n, dtype=torch.float64, device=device)
    passed = torch.zeros(n, dtype=torch.long, device=device)
    alive = episode_lengths > 0
    noisy_threshold = torch.as_tensor(noisy_threshold, dtype=torch.float64).to(device)
    states_evaluated = 0
    for k in range(int(episode_lengths.max()) if n else 0):
        runs = torch.nonzero(alive & (k < episode_lengths)).squeeze(1)
        if runs.numel() == 0:
            break
        log_q, advanced = stability_log_queries(
            expert_set, observations[runs, k], actions[runs, k], log_mass[:, runs], expert_chunk
        )
        states_evaluated += int(runs.numel())
        noisy_q = log_q.exp() + noise.laplace((int(runs.numel()),), budget.noise_scale).to(device)
        ok = noisy_q >= noisy_threshold[runs]
        passed[runs[ok]] = k + 1
        log_mass[:, runs[ok]] = advanced[:, ok]
        alive[runs[~ok]] = False
    return passed.cpu().numpy(), states_evaluated, log_mass.cpu()


def stability_log_queries(
    expert_set: ExpertSet,
    observations: torch.Tensor,
    actions: torch.Tensor,
    log_mass: torch.Tensor,
    expert_chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance per-expert prefix log-probabilities by one step; return (log q_k [n], advanced log_mass [m, n]).

    observations [n, d], actions [n]: step k of n runs; log_mass [m, n] float64 holds sum_{t<k} log pi_i(a_t | s_t)
    (zeros at k = 1). log q_k = logsumexp_i of the advanced masses.
    """
    log_probs = _expert_log_probs(expert_set, observations, expert_chunk)
    index = torch.as_tensor(actions, device=log_probs.device).long().view(1, -1, 1).expand(log_probs.shape[0], -1, 1)
    advanced = log_mass + log_probs.gather(2, index).squeeze(2).to(torch.float64)
    return torch.logsumexp(advanced, dim=0), advanced
