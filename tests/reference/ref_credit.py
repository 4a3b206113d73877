"""Loop references of creditlab.core.credit and creditlab.core.diagnostics (obviously correct, slow)."""

from __future__ import annotations

import math
from itertools import combinations

import torch


def grpo(rewards, group_ids, eps=1e-6):
    out = torch.zeros(len(rewards), dtype=torch.float64)
    for i in range(len(rewards)):
        members = [float(rewards[j]) for j in range(len(rewards)) if int(group_ids[j]) == int(group_ids[i])]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1)) if len(members) > 1 else 0.0
        out[i] = (float(rewards[i]) - mean) / (std + eps)
    return out


def spread(adv, weights, mask):
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        real = [t for t in range(T) if mask[i, t]]
        total = sum(float(weights[i, t]) for t in real)
        for t in real:
            out[i, t] = float(adv[i]) * (float(weights[i, t]) / total if total > 0 else 1.0 / len(real))
    return out


def uniform(adv, mask, conserve=True):
    B, T = mask.shape
    if conserve:
        return spread(adv, torch.ones(B, T), mask)
    return torch.tensor([[float(adv[i]) if mask[i, t] else 0.0 for t in range(T)] for i in range(B)],
                        dtype=torch.float64).reshape(B, T)


def per_turn(adv, dS, mask):
    return spread(adv, dS, mask)


def concentrated(adv, sel, mask):
    return spread(adv, (sel & mask).double(), mask)


def shuffled(credit, mask, keys):
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        real = [t for t in range(T) if mask[i, t]]
        dst = sorted(real, key=lambda t: float(keys[i, t]))
        for j, t in enumerate(real):
            out[i, dst[j]] = float(credit[i, t])
    return out


def reward_to_go(r, group_ids, mask, eps=1e-6):
    B, T = mask.shape
    R = [sum(float(r[i, t]) for t in range(T) if mask[i, t]) for i in range(B)]
    out = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        members = [R[j] for j in range(B) if int(group_ids[j]) == int(group_ids[i])]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1)) if len(members) > 1 else 0.0
        for t in range(T):
            if mask[i, t]:
                togo = sum(float(r[i, u]) for u in range(t, T) if mask[i, u])
                out[i, t] = (togo - mean) / (std + eps)
    return out


def p_cover_enum(T, C, k):
    """Probability that k steps drawn at random among T cover C fixed causal steps, by enumeration."""
    causal = set(range(C))
    subsets = list(combinations(range(T), k))
    return sum(causal <= set(s) for s in subsets) / len(subsets)


def open_fraction_sum(q, C):
    return sum(q**j for j in range(1, C + 1)) / C
