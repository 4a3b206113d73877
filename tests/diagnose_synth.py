"""Synthetic rollout-dump rows for the diagnose tests: a clean multi-turn dump, and knobs to plant each
failure the checks look for."""

from __future__ import annotations

import math

import numpy as np


def token_row(rng: np.random.Generator, turn_lengths, *, obs_len: int = 8, prompt_len: int = 6,
              noise: float = 0.003, bias: float = 0.0, leak_obs: bool = False) -> dict:
    """Token columns of one multi-turn trajectory in verl's layout: prompt, then turns separated by
    tool observations. The learner has real log-probs everywhere; the engine reports 0.0 off policy
    tokens; on policy tokens ``rollout = learner - (bias + noise * N(0, 1))``, so
    ``delta = learner - rollout`` has mean ``bias``. ``leak_obs``: observation tokens enter the policy
    mask (the placeholder failure)."""
    pm, turn = [False] * prompt_len, [-1] * prompt_len
    for t, n in enumerate(turn_lengths):
        pm += [True] * n
        turn += [t] * n
        if t < len(turn_lengths) - 1:
            pm += [leak_obs] * obs_len
            turn += [t] * obs_len
    pm = np.asarray(pm)
    margin = 5 * noise + abs(bias)  # keeps the engine's log-probs below 0, as real ones are
    lp = -rng.uniform(0.2 + margin, 3.0 + margin, pm.size)
    delta = bias + noise * rng.standard_normal(pm.size)
    rollout = np.where(pm, np.minimum(lp - delta, -1e-6), 0.0)
    if leak_obs:  # the leaked observation tokens keep the engine's placeholder 0.0
        obs = np.ones(pm.size, dtype=bool)
        obs[:prompt_len] = False
        k = prompt_len
        for t, n in enumerate(turn_lengths):
            obs[k:k + n] = False
            k += n + (obs_len if t < len(turn_lengths) - 1 else 0)
        rollout = np.where(obs, 0.0, rollout)
    return {"logprobs": lp.tolist(), "rollout_logprobs": rollout.tolist(), "policy_mask": pm.tolist(),
            "turn_ids": turn}


def clean_rows(seed: int = 0, *, steps: int = 8, groups: int = 8, group_size: int = 4, turns: int = 3,
               noise: float = 0.003, tokens: bool = True, **kw) -> list[dict]:
    """A dump with nothing wrong: small symmetric mismatch, mixed rewards in every group, steady
    length and precision."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(steps):
        for g in range(groups):
            rewards = rng.permutation([1.0, 0.0] + list(rng.integers(0, 2, group_size - 2).astype(float)))
            for r in rewards:
                lens = rng.integers(16, 40, turns).tolist()
                row = {"step": s, "group": f"prompt-{g}", "reward": float(r),
                       "precision": float(np.clip(0.8 + 0.05 * rng.standard_normal(), 0, 1)),
                       "process_reward": float(rng.uniform(0, 1))}
                if tokens:
                    row.update(token_row(rng, lens, noise=noise, **kw))
                else:
                    row["response_length"] = float(sum(lens))
                rows.append(row)
    return rows


def topk_row(rng: np.random.Generator, n: int, *, vocab: int = 50, k: int | None = 5, noise: float = 0.0) -> dict:
    """One single-turn trajectory sampled from random categoricals. ``k``: the engine samples from the top-k
    renormalised distribution and reports its log-probs, the learner scores the full distribution
    (``None``: both use the full distribution, ``noise`` apart)."""
    logits = 2.0 * rng.standard_normal((n, vocab))
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    if k is None:
        p = np.exp(logp)
        tok = np.array([rng.choice(vocab, p=row) for row in p])
        lp = logp[np.arange(n), tok]
        return {"logprobs": lp.tolist(), "rollout_logprobs": (lp - noise * rng.standard_normal(n)).tolist(),
                "policy_mask": [True] * n}
    top = np.argsort(-logp, axis=1)[:, :k]
    keep = np.take_along_axis(logp, top, 1)
    z = np.log(np.exp(keep).sum(1))
    pick = np.array([rng.choice(k, p=np.exp(row - zz)) for row, zz in zip(keep, z, strict=True)])
    lp = keep[np.arange(n), pick]  # learner: full distribution
    return {"logprobs": lp.tolist(), "rollout_logprobs": (lp - z).tolist(), "policy_mask": [True] * n}


CHAIN_TURNS = [
    {"tool": "find_user", "args": {"name": "ann"}, "returned": ["u1"], "is_write": False},
    {"tool": "get_orders", "args": {"user_id": "u1"}, "returned": ["o7"], "is_write": False},
    {"tool": "list_products", "args": {}, "returned": ["p1"], "is_write": False},
    {"tool": "cancel", "args": {"order_id": "o7"}, "returned": ["ok"], "is_write": True},
]
"""A trajectory whose chain by dataflow is find_user -> get_orders -> cancel (C = 3 of T = 4 calls)."""


def trend_rows(seed: int = 0, *, length_growth: float = 0.0, precision_drop: float = 0.0, reward_rise: float = 0.3,
               process_rise: float = 0.0, steps: int = 8) -> list[dict]:
    """A dump without token columns whose response length grows by ``length_growth`` (relative), precision
    falls by ``precision_drop`` and the process reward rises by ``process_rise`` from the first to the last
    step, while the reward rises a little (``reward_rise``: share of failures turned into successes)."""
    rows = clean_rows(seed, steps=steps, tokens=False)
    rng = np.random.default_rng(seed + 1)
    for r in rows:
        f = r["step"] / (steps - 1)
        r["response_length"] *= 1 + length_growth * f
        r["precision"] = float(np.clip(r["precision"] - precision_drop * f, 0, 1))
        r["process_reward"] = float(np.clip(0.3 * r["process_reward"] + process_rise * f, 0, 1))
        if r["reward"] == 0 and rng.random() < reward_rise * f:
            r["reward"] = 1.0
    return rows


def padded_tensors(rows: list[dict]):
    """``(logprobs, rollout_logprobs, policy_mask)`` ``(B, L)`` of token rows, zero-padded to the longest."""
    import torch

    L = max(len(r["logprobs"]) for r in rows)
    B = len(rows)
    old, roll = torch.zeros(B, L, dtype=torch.float64), torch.zeros(B, L, dtype=torch.float64)
    pm = torch.zeros(B, L, dtype=torch.bool)
    for b, r in enumerate(rows):
        n = len(r["logprobs"])
        old[b, :n] = torch.tensor(r["logprobs"], dtype=torch.float64)
        roll[b, :n] = torch.tensor(r["rollout_logprobs"], dtype=torch.float64)
        pm[b, :n] = torch.tensor(r["policy_mask"])
    return old, roll, pm


def agent_process_row(rng: np.random.Generator, step: int, group: int, *, turns: int, policy_tokens: int, k3: float,
                      tool: int = 20) -> dict:
    """One trajectory of a long agent run: ``turns`` turns of ``policy_tokens / turns`` policy tokens, each
    followed by ``tool`` tool tokens, and a per-token log ratio drawn as the same process whatever the length:
    ``delta = learner - engine ~ N(-k3, 2 k3)`` independently per policy token, so that K3 per token is ``k3``
    (for a Gaussian log ratio ``E[exp(delta) - 1 - delta] = sigma^2 / 2``) and ``E[exp(delta)] = 1``, as a ratio
    of two distributions has."""
    per = policy_tokens // turns
    L = turns * (per + tool)
    pm = np.tile(np.r_[np.ones(per, dtype=bool), np.zeros(tool, dtype=bool)], turns)
    tid = np.repeat(np.arange(turns), per + tool)
    sigma = math.sqrt(2 * k3)
    lp = -rng.uniform(0.1 + 6 * sigma, 3.0 + 6 * sigma, L)  # both sides stay below 0 without clipping
    delta = -k3 + sigma * rng.standard_normal(L)
    rollout = np.where(pm, lp - delta, 0.0)
    return {"step": step, "group": group, "reward": float(rng.random() < 0.5), "logprobs": lp.tolist(),
            "rollout_logprobs": rollout.tolist(), "policy_mask": pm.tolist(), "turn_ids": tid.tolist()}


def agent_process_rows(seed: int = 0, *, turns: int, policy_tokens: int, k3: float, k3_end: float | None = None,
                       steps: int = 8, rows_per_step: int = 16) -> list[dict]:
    """A dump of :func:`agent_process_row` rows, groups of 4; with ``k3_end``, K3 per token moves geometrically
    from ``k3`` at the first step to ``k3_end`` at the last (a mismatch that grows over training)."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(steps):
        k = k3 if k3_end is None else k3 * (k3_end / k3) ** (s / max(steps - 1, 1))
        out += [agent_process_row(rng, s, i // 4, turns=turns, policy_tokens=policy_tokens, k3=k)
                for i in range(rows_per_step)]
    return out
