"""Loop references of ``creditlab.core.losses`` and ``prm_mixed_advantages``.

Plain Python over rows, tokens and vocabulary entries with ``math``; inputs are nested lists.
"""

from __future__ import annotations

import math


def ref_aggregate(loss, mask, mode, norm=None):
    rows = []
    for lr, mr in zip(loss, mask, strict=True):
        vals = [x for x, m in zip(lr, mr, strict=True) if m]
        rows.append(vals)
    if mode == "token_mean":
        flat = [x for r in rows for x in r]
        return sum(flat) / len(flat) if flat else 0.0
    nonempty = [r for r in rows if r]
    if not nonempty:
        return 0.0
    if mode == "seq_mean_token_sum_norm":
        L = len(loss[0])
        return sum(sum(r) for r in nonempty) / len(nonempty) / (L if norm is None else norm)
    if mode == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    if mode == "seq_mean_token_sum":
        return sum(sum(r) for r in nonempty) / len(nonempty)
    raise ValueError(mode)


def ref_policy_token_losses(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2, weights=None,
                            clip_ratio_c=None):
    """Per-token clipped surrogate (0 on masked tokens) and per-token 'clipped branch active' flags."""
    out, clipped = [], []
    for b in range(len(mask)):
        row, crow = [], []
        for t in range(len(mask[b])):
            if not mask[b][t]:
                row.append(0.0)
                crow.append(False)
                continue
            a = adv[b] if not isinstance(adv[b], list) else adv[b][t]
            r = math.exp(max(min(logprobs[b][t] - old[b][t], 20.0), -20.0))
            u = -a * r
            c = -a * min(max(r, 1 - clip_low), 1 + clip_high)
            w = 1.0 if weights is None else weights[b][t]
            loss = max(u, c)
            if clip_ratio_c is not None and a < 0:
                loss = min(loss, -a * clip_ratio_c)
            row.append(loss * w)
            crow.append(c > u)
        out.append(row)
        clipped.append(crow)
    return out, clipped


def _log_softmax(v):
    m = max(v)
    z = math.log(sum(math.exp(x - m) for x in v)) + m
    return [x - z for x in v]


def _kl(lp, lq):
    return sum(math.exp(a) * (a - b) for a, b in zip(lp, lq, strict=True))


def ref_jsd_tokens(student_logits, teacher_logits, mask, beta):
    """Per-token generalised JSD (0 on masked tokens), M = beta P_T + (1 - beta) P_S."""
    out = []
    for b in range(len(mask)):
        row = []
        for t in range(len(mask[b])):
            if not mask[b][t]:
                row.append(0.0)
                continue
            ls = _log_softmax(student_logits[b][t])
            lt = _log_softmax(teacher_logits[b][t])
            if beta == 0.0:
                row.append(_kl(lt, ls))
            elif beta == 1.0:
                row.append(_kl(ls, lt))
            else:
                lm = [math.log(beta * math.exp(x) + (1 - beta) * math.exp(y))
                      for x, y in zip(lt, ls, strict=True)]
                row.append(beta * _kl(lt, lm) + (1 - beta) * _kl(ls, lm))
        out.append(row)
    return out


def _mean_std(values):
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, std


def ref_prm_mixed(outcome, scores, mask, groups, lam, eps=1e-6):
    B = len(outcome)
    out = [[0.0] * len(scores[b]) for b in range(B)]
    for g in set(groups):
        members = [b for b in range(B) if groups[b] == g]
        m_out, s_out = _mean_std([outcome[b] for b in members])
        turn_vals = [scores[b][t] for b in members for t in range(len(scores[b])) if mask[b][t]]
        m_proc, s_proc = _mean_std(turn_vals) if turn_vals else (0.0, 0.0)
        for b in members:
            a_out = (outcome[b] - m_out) / (s_out + eps)
            for t in range(len(scores[b])):
                if mask[b][t]:
                    out[b][t] = a_out + lam * (scores[b][t] - m_proc) / (s_proc + eps)
    return out
