"""``M`` independent small MLP policies evaluated as one batched tensor program.

``logits = tanh(x W1 + b1) W2 + b2`` per model, with a hand-written backward pass and a batched
Adam step with a per-model global grad-norm clip. Writing the backward by hand (two batched matmuls
each way) instead of going through autograd is what makes hundreds of models x hundreds of updates
run in seconds on a CPU; ``tests/reference/ref_chain.py`` checks it against ``torch.nn`` +
autograd + ``torch.optim.Adam`` model by model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BatchedAdam", "BatchedMLP"]

PARAMS = ("W1", "b1", "W2", "b2")


@dataclass
class BatchedMLP:
    W1: torch.Tensor  # (M, D, H)
    b1: torch.Tensor  # (M, H)
    W2: torch.Tensor  # (M, H, K)
    b2: torch.Tensor  # (M, K)

    @classmethod
    def init(cls, seeds: list[int], D: int, H: int, K: int) -> BatchedMLP:
        """PyTorch ``nn.Linear`` default init (uniform +-1/sqrt(fan_in)) drawn per seed, so every
        model with the same seed starts from the same weights (paired arms)."""
        ws = {k: [] for k in PARAMS}
        for seed in seeds:
            g = torch.Generator().manual_seed(int(seed) * 9176 + 17)
            b_in, b_h = 1 / D**0.5, 1 / H**0.5
            ws["W1"].append((torch.rand(D, H, generator=g) * 2 - 1) * b_in)
            ws["b1"].append((torch.rand(H, generator=g) * 2 - 1) * b_in)
            ws["W2"].append((torch.rand(H, K, generator=g) * 2 - 1) * b_h)
            ws["b2"].append((torch.rand(K, generator=g) * 2 - 1) * b_h)
        return cls(**{k: torch.stack(v) for k, v in ws.items()})

    def params(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in PARAMS}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``(M, N, D)`` -> ``(logits (M, N, K), hidden (M, N, H))``."""
        h = torch.tanh(torch.baddbmm(self.b1.unsqueeze(1), x, self.W1))
        return torch.baddbmm(self.b2.unsqueeze(1), h, self.W2), h

    def backward(self, x: torch.Tensor, h: torch.Tensor, dlogits: torch.Tensor) -> dict[str, torch.Tensor]:
        """Gradients of ``sum(dlogits * logits)`` w.r.t. the parameters, per model."""
        dW2 = torch.bmm(h.transpose(1, 2), dlogits)
        db2 = dlogits.sum(1)
        dpre = torch.bmm(dlogits, self.W2.transpose(1, 2)) * (1 - h * h)
        dW1 = torch.bmm(x.transpose(1, 2), dpre)
        db1 = dpre.sum(1)
        return {"W1": dW1, "b1": db1, "W2": dW2, "b2": db2}


class BatchedAdam:
    """Adam (the ``torch.optim.Adam`` update, no weight decay) on a :class:`BatchedMLP`, after a
    per-model global grad-norm clip (``torch.nn.utils.clip_grad_norm_`` semantics)."""

    def __init__(self, model: BatchedMLP, lr: float, max_grad_norm: float | None,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.model, self.lr, self.max_grad_norm, self.betas, self.eps = model, lr, max_grad_norm, betas, eps
        self.m = {k: torch.zeros_like(v) for k, v in model.params().items()}
        self.v = {k: torch.zeros_like(v) for k, v in model.params().items()}
        self.t = 0

    def step(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """Apply one update; returns the per-model gradient norm before clipping ``(M,)``."""
        M = next(iter(grads.values())).shape[0]
        norm = torch.sqrt(sum((g.reshape(M, -1) ** 2).sum(-1) for g in grads.values()))
        if self.max_grad_norm is not None:
            coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        else:
            coef = torch.ones_like(norm)
        self.t += 1
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1**self.t, 1 - b2**self.t
        for k, g in grads.items():
            g = g * coef.view(M, *([1] * (g.dim() - 1)))
            self.m[k].mul_(b1).add_(g, alpha=1 - b1)
            self.v[k].mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (self.v[k].sqrt() / bc2**0.5).add_(self.eps)
            getattr(self.model, k).addcdiv_(self.m[k], denom, value=-self.lr / bc1)
        return norm
