"""Loop reference of ``creditlab.core.precision`` for one response at a time, plain Python lists."""

from __future__ import annotations


def ref_fork_one(match, coverage, weights, correct, tau, beta=1.0, mode="fork"):
    """``match[j][i]`` bool (J x n), ``coverage[j]``, ``weights[j]``, ``correct[i]``.

    Returns ``(reward, precision, recall, credits, necessary)``.
    """
    n = len(correct)
    credits = [0.0] * n
    for j, row in enumerate(match):
        if weights[j] <= 0:
            continue
        k = sum(1 for i in range(n) if row[i])
        for i in range(n):
            if row[i]:
                credits[i] += 1.0 / k
    necessary = [credits[i] >= tau - 1e-6 for i in range(n)]
    good = sum(1 for i in range(n) if necessary[i] and correct[i])
    p = good / n if n else 0.0
    pos = sum(w for w in weights if w > 0)
    if pos > 0:
        earned = sum(w for w, s in zip(weights, coverage, strict=True) if s)
        rec = min(1.0, max(0.0, earned / pos))
    else:
        rec = 0.0 if any(s and w < 0 for w, s in zip(weights, coverage, strict=True)) else 1.0
    if mode == "recall":
        r = rec
    elif mode == "mean":
        r = (p + rec) / 2
    else:
        b = 2.0 if mode == "f2" else beta
        den = b * b * p + rec
        r = (1 + b * b) * p * rec / den if den > 0 else 0.0
    return r, p, rec, credits, necessary


def ref_deletion_curve(match, weights, scores, U):
    """Recall after deleting k = 0..U units, least necessary first (ties by index), one response."""
    n = len(scores)
    order = sorted(range(n), key=lambda i: (scores[i], i))
    curve = []
    for k in range(U + 1):
        gone = set(order[: min(k, n)])
        cov = [any(row[i] for i in range(n) if i not in gone) for row in match]
        pos = sum(w for w in weights if w > 0)
        if pos > 0:
            rec = min(1.0, max(0.0, sum(w for w, s in zip(weights, cov, strict=True) if s) / pos))
        else:
            rec = 0.0 if any(s and w < 0 for w, s in zip(weights, cov, strict=True)) else 1.0
        curve.append(rec)
    free = n
    for k in range(1, n + 1):
        if curve[k] < curve[0] - 1e-6:
            free = k - 1
            break
    return curve, (free / n if n else None)
