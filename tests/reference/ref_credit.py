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


def random_k(adv, keys, k, mask):
    """Credit A_i / k on the k real steps of each row with the smallest keys (all of them if fewer)."""
    B, T = mask.shape
    sel = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        real = sorted((t for t in range(T) if mask[i, t]), key=lambda t: float(keys[i, t]))
        k_i = int(k[i]) if isinstance(k, torch.Tensor) else int(k)
        for t in real[:k_i]:
            sel[i, t] = True
    return concentrated(adv, sel, mask)


def targeted(adv, local, exposed, group_ids, mask, eps=1e-6, conserve=True):
    """Per step t, the local signal normalised over the rollouts of the group that have step t; kept on
    exposed steps; each row rescaled to total |A_i| (0 when nothing is left)."""
    B, T = mask.shape
    loc = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if not (mask[i, t] and exposed[i, t]):
                continue
            vals = [float(local[j, t]) for j in range(B) if int(group_ids[j]) == int(group_ids[i]) and mask[j, t]]
            mean = sum(vals) / len(vals)
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
            loc[i][t] = (float(local[i, t]) - mean) / (std + eps)
    out = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        mass = sum(abs(x) for x in loc[i])
        for t in range(T):
            if not conserve:
                out[i, t] = loc[i][t] * abs(float(adv[i]))
            elif mass > 0:
                out[i, t] = loc[i][t] * abs(float(adv[i])) / mass
    return out
