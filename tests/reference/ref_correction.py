"""Loop references of ``creditlab.core.masks`` and ``creditlab.core.correction``.

Plain Python over rows, tokens and segments, with ``math`` on floats: slow and obvious.
Inputs are nested lists (or tensors converted with ``.tolist()``).
"""

from __future__ import annotations

import math


def ref_segments(policy: list[list[bool]]) -> list[list[tuple[int, int, int]]]:
    """Per row, the segments as ``(start, end_exclusive, turn)``."""
    out = []
    for row in policy:
        segs, t, turn = [], 0, 0
        while t < len(row):
            if row[t]:
                s = t
                while t < len(row) and row[t]:
                    t += 1
                segs.append((s, t, turn))
                turn += 1
            else:
                t += 1
        out.append(segs)
    return out


def ref_seg_ids(policy):
    """``(seg_id, turn_index, lengths, rows, turns, n_segments)`` as lists."""
    seg_id = [[-1] * len(r) for r in policy]
    turn_index = [[-1] * len(r) for r in policy]
    lengths, rows, turns, n_segments = [], [], [], []
    k = 0
    for b, segs in enumerate(ref_segments(policy)):
        n_segments.append(len(segs))
        for s, e, turn in segs:
            for t in range(s, e):
                seg_id[b][t] = k
                turn_index[b][t] = turn
            lengths.append(e - s)
            rows.append(b)
            turns.append(turn)
            k += 1
    return seg_id, turn_index, lengths, rows, turns, n_segments


def ref_allocate_budget(C, rho, alpha_g, iters=200):
    """alpha_s = min(c rho_s, 1) with c by plain bisection on the budget (see docs/design.md 3.5)."""
    target = alpha_g**2 * sum(C)
    pos = [c > 0 and r > 0 for c, r in zip(C, rho, strict=True)]
    if not any(pos):
        return [alpha_g] * len(C)

    def spent(c):
        return sum(Ci * min(c * ri, 1.0) ** 2 for Ci, ri in zip(C, rho, strict=True))

    hi = 1.0 / min(r for r, p in zip(rho, pos, strict=True) if p)
    if spent(hi) <= target:
        c = hi
    else:
        lo = 0.0
        for _ in range(iters):
            mid = 0.5 * (lo + hi)
            if spent(mid) < target:
                lo = mid
            else:
                hi = mid
        c = hi
    return [min(c * r, 1.0) for r in rho]


def ref_interq(old, rollout, policy, *, eps_low=0.025, eps_high=0.05, alpha_g=0.5, rho_eps=1e-8,
               mode="interq"):
    """Return ``(weights, C, rho, alpha, clipped)`` following docs/design.md section 3 step by step."""
    B = len(policy)
    prefix_w = [[1.0] * len(r) for r in policy]
    clipped = [[False] * len(r) for r in policy]
    for b in range(B):
        E, n = 0.0, 0
        for t in range(len(policy[b])):
            if not policy[b][t]:
                continue
            E += old[b][t] - rollout[b][t]
            n += 1
            hi, lo = eps_high * math.sqrt(n), -eps_low * math.sqrt(n)
            clipped[b][t] = E > hi or E < lo
            prefix_w[b][t] = math.exp(min(max(E, lo), hi))
    C, rho, segs = [], [], []
    for b, row_segs in enumerate(ref_segments(policy)):
        for s, e, _turn in row_segs:
            d = [prefix_w[b][t] - 1.0 for t in range(s, e)]
            n_s = e - s
            sq = sum(x * x for x in d)
            Cs = sq / n_s
            ess = (sum(abs(x) for x in d)) ** 2 / sq if sq > 0 else 1.0
            r = 0.0 if n_s == 1 else (ess - 1.0) / (n_s - 1) * (Cs / (Cs + rho_eps))
            r = min(max(r, 0.0), 1.0) if Cs > 0 else 0.0
            C.append(Cs)
            rho.append(r)
            segs.append((b, s, e))
    if mode == "interq":
        alpha = ref_allocate_budget(C, rho, alpha_g)
    elif mode == "prefix":
        alpha = [1.0] * len(C)
    else:
        alpha = [alpha_g] * len(C)
    weights = [[1.0] * len(r) for r in policy]
    for (b, s, e), a in zip(segs, alpha, strict=True):
        for t in range(s, e):
            weights[b][t] = 1.0 + a * (prefix_w[b][t] - 1.0)
    return weights, C, rho, alpha, clipped


def _delta(old, rollout, policy, b, t):
    return old[b][t] - rollout[b][t] if policy[b][t] else 0.0


def ref_tis(old, rollout, policy, cap=2.0):
    return [[min(math.exp(_delta(old, rollout, policy, b, t)), cap) if policy[b][t] else 1.0
             for t in range(len(policy[b]))] for b in range(len(policy))]


def ref_interq_tis(old, rollout, policy, *, cap=2.0, **interq):
    """``W_t * min(exp(delta_t), cap)`` token by token, ``W_t`` of :func:`ref_interq` (mode ``interq``)."""
    w = ref_interq(old, rollout, policy, **interq)[0]
    t = ref_tis(old, rollout, policy, cap)
    return [[w[b][i] * t[b][i] for i in range(len(policy[b]))] for b in range(len(policy))]


def ref_mis(old, rollout, policy, lo=0.5, hi=2.0):
    out = []
    for b in range(len(policy)):
        row = []
        for t in range(len(policy[b])):
            if not policy[b][t]:
                row.append(1.0)
                continue
            r = math.exp(old[b][t] - rollout[b][t])
            row.append(r if lo <= r <= hi else 0.0)
        out.append(row)
    return out


def ref_seq_is(old, rollout, policy, cap=2.0):
    out = []
    for b in range(len(policy)):
        total = sum(_delta(old, rollout, policy, b, t) for t in range(len(policy[b])))
        w = math.exp(min(total, math.log(cap)))
        out.append([w if p else 1.0 for p in policy[b]])
    return out


def ref_geo(old, rollout, policy):
    out = []
    for b in range(len(policy)):
        ds = [old[b][t] - rollout[b][t] for t in range(len(policy[b])) if policy[b][t]]
        w = math.exp(sum(ds) / len(ds)) if ds else 1.0
        out.append([w if p else 1.0 for p in policy[b]])
    return out


def ref_mismatch(old, rollout, policy, max_turns=8):
    """Token and sequence K1/K2/K3/chi2, mean |delta| and per-turn current/prefix log ratios."""
    tok = {"k1": [], "k2": [], "k3": [], "chi2": [], "abs": []}
    seq = {"k1": [], "k2": [], "k3": [], "chi2": []}
    cur: dict[int, list[float]] = {}
    pre: dict[int, list[float]] = {}
    for b, row_segs in enumerate(ref_segments(policy)):
        E = 0.0
        for s, e, turn in row_segs:
            for t in range(s, e):
                d = old[b][t] - rollout[b][t]
                E += d
                r = math.exp(d)
                tok["k1"].append(-d)
                tok["k2"].append(d * d / 2)
                tok["k3"].append(r - 1 - d)
                tok["chi2"].append((r - 1) ** 2)
                tok["abs"].append(abs(d))
                if turn < max_turns:
                    cur.setdefault(turn, []).append(d)
                    pre.setdefault(turn, []).append(E)
        if row_segs:
            S = E
            Sc = min(S, 80.0)
            seq["k1"].append(-S)
            seq["k2"].append(S * S / 2)
            seq["k3"].append(math.exp(Sc) - 1 - Sc)
            seq["chi2"].append((math.exp(Sc) - 1) ** 2)

    def mean(v):
        return sum(v) / len(v) if v else 0.0

    out = {f"mismatch/{k}": mean(v) for k, v in tok.items() if k != "abs"}
    out["mismatch/mean_abs_delta"] = mean(tok["abs"])
    out.update({f"mismatch/seq_{k}": mean(v) for k, v in seq.items()})
    for k in cur:
        out[f"mismatch/turn{k}/current"] = mean(cur[k])
        out[f"mismatch/turn{k}/prefix"] = mean(pre[k])
        out[f"mismatch/turn{k}/tokens"] = float(len(cur[k]))
    return out
