"""A straightforward per-seed loop implementation of the coverage-lab trainer, with torch.nn,
autograd and torch.optim.Adam, one model at a time. The batched trainer
(creditlab.train.chain.train_chain) must reproduce it; the benchmark times both."""

from __future__ import annotations

import torch

from creditlab.envs.chain import make_tasks, obs_dim, observe
from creditlab.models.batched_mlp import BatchedMLP
from creditlab.train.chain import ChainTrainConfig, ModelSpec, _exposed_steps


class Policy(torch.nn.Module):
    def __init__(self, D, H, K):
        super().__init__()
        self.l1 = torch.nn.Linear(D, H)
        self.l2 = torch.nn.Linear(H, K)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def _grpo(rewards, eps=1e-6):
    G = len(rewards)
    mean = sum(rewards) / G
    std = (sum((r - mean) ** 2 for r in rewards) / (G - 1)) ** 0.5
    return [(r - mean) / (std + eps) for r in rewards]


def _spread(a, weights):
    total = sum(weights)
    return [a * (w / total if total > 0 else 1 / len(weights)) for w in weights]


def train_one(spec: ModelSpec, cfg: ChainTrainConfig) -> list[float]:
    """Train one model; returns the exact expected reward at the evaluation points."""
    T, K, G = cfg.T, cfg.K, cfg.group
    task = make_tasks(T, K, [spec.C], [spec.seed])
    exposed = _exposed_steps(task, [spec])[0]
    causal = task.causal_pos[0, : spec.C].tolist()
    correct = task.correct[0].tolist()
    init = BatchedMLP.init([spec.seed], obs_dim(T, cfg.state_dependent), cfg.hidden, K)
    pol = Policy(obs_dim(T, cfg.state_dependent), cfg.hidden, K)
    with torch.no_grad():
        pol.l1.weight.copy_(init.W1[0].T)
        pol.l1.bias.copy_(init.b1[0])
        pol.l2.weight.copy_(init.W2[0].T)
        pol.l2.bias.copy_(init.b2[0])
    opt = torch.optim.Adam(pol.parameters(), lr=cfg.lr, eps=cfg.adam_eps)
    stream = torch.Generator().manual_seed(int(spec.seed) * 15_485_863 + 3)
    eval_at = torch.unique(torch.linspace(0, cfg.updates, cfg.eval_points + 1).round().long()[1:]).tolist()
    scores = []
    for u in range(cfg.updates):
        noise = torch.rand(3, G, T, generator=stream)
        xs, acts = [], []
        for g in range(G):
            prefix, broken = 0, False
            row_x, row_a = [], []
            for t in range(T):
                if cfg.state_dependent:
                    x = observe(T, torch.tensor(t), torch.tensor(prefix), torch.tensor(broken))
                else:
                    x = observe(T, torch.tensor(t))
                with torch.no_grad():
                    cdf = torch.softmax(pol(x), -1).cumsum(-1)
                a = int((noise[0, g, t] > cdf[:-1]).sum())
                if t in causal:
                    ok = a == correct[t]
                    prefix += int(ok and not broken)
                    broken = broken or not ok
                row_x.append(x)
                row_a.append(a)
            xs.append(torch.stack(row_x))
            acts.append(row_a)
        rewards, prefixes, step_ok = [], [], []
        for g in range(G):
            n = 0
            for t in causal:
                if acts[g][t] != correct[t]:
                    break
                n += 1
            prefixes.append(n)
            rewards.append(n / spec.C)
            step_ok.append([1.0 if (t in causal and acts[g][t] == correct[t]) else 0.0 for t in range(T)])
        A = _grpo(rewards)
        credit = []
        for g in range(G):
            if spec.arm == "uniform":
                c = _spread(A[g], [1.0] * T)
            elif spec.arm == "concentrated":
                c = _spread(A[g], [1.0 if t in causal[: spec.k] else 0.0 for t in range(T)])
            elif spec.arm == "random_k":
                chosen = sorted(range(T), key=lambda t: float(noise[2, g, t]))[: spec.k]
                c = _spread(A[g], [1.0 if t in chosen else 0.0 for t in range(T)])
            elif spec.arm in ("per_turn", "shuffled"):
                seen = [1.0 if (t in causal and causal.index(t) < prefixes[g] and exposed[t]) else 0.0
                        for t in range(T)]
                c = _spread(A[g], seen)
                if spec.arm == "shuffled":
                    dst = sorted(range(T), key=lambda t: float(noise[1, g, t]))
                    out = [0.0] * T
                    for j in range(T):
                        out[dst[j]] = c[j]
                    c = out
            else:  # targeted
                loc = []
                for t in range(T):
                    if not exposed[t]:
                        loc.append(0.0)
                        continue
                    col = torch.tensor([step_ok[h][t] for h in range(G)])
                    loc.append(float((step_ok[g][t] - col.mean()) / (col.std() + 1e-6)))
                mass = sum(abs(v) for v in loc)
                c = [v * abs(A[g]) / mass if mass > 0 else 0.0 for v in loc]
            credit.append(c)
        opt.zero_grad()
        loss = 0.0
        for g in range(G):
            logp = torch.log_softmax(pol(xs[g]), -1)
            for t in range(T):
                loss = loss - credit[g][t] * logp[t, acts[g][t]] / G
        loss.backward()
        torch.nn.utils.clip_grad_norm_(pol.parameters(), cfg.max_grad_norm)
        opt.step()
        if u + 1 in eval_at:
            with torch.no_grad():
                p_alive, total = 1.0, 0.0
                for j, t in enumerate(causal):
                    if cfg.state_dependent:
                        x = observe(T, torch.tensor(t), torch.tensor(j), torch.tensor(False))
                    else:
                        x = observe(T, torch.tensor(t))
                    p_alive *= float(torch.softmax(pol(x), -1)[correct[t]])
                    total += p_alive
                scores.append(total / spec.C)
    return scores


def train_loop(specs: list[ModelSpec], cfg: ChainTrainConfig) -> torch.Tensor:
    """One model at a time; returns the learning curves ``(M, E)``."""
    return torch.tensor([train_one(s, cfg) for s in specs])
