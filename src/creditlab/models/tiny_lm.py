"""A tiny nanoGPT-style causal transformer with fake-quantized execution paths and a KV cache.

One module, after nanoGPT (Karpathy): learned token and position embeddings (plus, by default, an
embedding of the previous token, the "smeared key" of Olsson et al. 2022), ``n_layer`` pre-norm
blocks (causal self-attention + GELU MLP), a final LayerNorm and an LM head tied to the token embedding.

Execution precisions (:data:`creditlab.models.quant.PRECISIONS`):

- ``fp32``: exact.
- ``bf16``: weights, linear inputs and outputs and the KV cache rounded to bfloat16.
- ``fp8``: FP8 E4M3 **W8A8-KV8**: block-wise weight scales, per-token activation scales at the
  input of every linear layer inside the blocks, per-token-per-head scales on keys and values.
- ``int8``: INT8 **W8A8**: per-output-channel weight scales, per-token activation scales.
- ``nvfp4`` / ``mxfp4``: FP4 E2M1 **W4A4-KV8**: weights and the input of every linear layer in
  blocks of 16 (NVFP4, FP8 block scales) or 32 (MXFP4, power-of-two block scales) along the
  reduction dimension; keys and values in FP8 per token per head, as for ``fp8``.

Embeddings, LayerNorms, softmax and the LM head stay in fp32 (as in FP8 serving stacks that keep
the head in high precision). The same rules apply in the full-sequence :meth:`TinyLM.forward` (the
learner; with gradients it is quantization-aware training, straight-through) and in the incremental
:meth:`TinyLM.step` (the rollout engine, with a KV cache). Every quantizer is per row (token,
token x head), so a quantized full forward and quantized incremental decoding see the same grid
values; the engine differs from the QAT learner only in what a QAT learner does not copy: the 8-bit GEMMs of
the engine write bf16 outputs, and the summation order differs. That leaves the small residual
mismatch between a quantized engine and a QAT learner that QAT-aligned trainers still see.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from creditlab.errors import ConfigError, InputError
from creditlab.models.quant import EngineFormat, quant_act, quant_bf16, quant_kv, quant_weight

__all__ = ["KVCache", "StackedKVCache", "StackedTinyLM", "TinyLM", "TinyLMConfig"]


@dataclass(frozen=True)
class TinyLMConfig:
    """Shape of the model."""

    vocab_size: int
    """Number of token ids."""
    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    d_model: int = 64
    """Residual stream width (divisible by ``n_head``)."""
    max_len: int = 192
    """Longest sequence (learned position embeddings)."""
    mlp_ratio: int = 4
    """MLP hidden width / ``d_model``."""
    fp8_block: int = 32
    """Tile size of the block-wise FP8 weight scales."""
    tie_embeddings: bool = True
    """Share the token embedding with the LM head (nanoGPT's weight tying)."""
    token_shift: bool = True
    """Add an embedding of the previous token to each position's input ("smeared keys", Olsson et
    al. 2022): copying the id that follows a matching attribute then needs one attention layer."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "max_len", "mlp_ratio", "fp8_block"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ConfigError("d_model", f"{self.d_model} is not divisible by n_head={self.n_head}")


class KVCache:
    """Keys and values ``(n_layer, B, H, max_len, head_dim)`` plus the engine's quantized weights.

    All sequences of the batch advance together, one position per :meth:`TinyLM.step`.
    """

    def __init__(self, model: TinyLM, batch: int, precision: str, max_len: int | None = None, exact: bool = False):
        cfg = model.cfg
        self.precision = EngineFormat.parse(precision)
        self.exact = bool(exact)
        self.max_len = int(max_len or cfg.max_len)
        if self.max_len > cfg.max_len:
            raise ConfigError("max_len", f"{self.max_len} exceeds the model's max_len {cfg.max_len}")
        hd = cfg.d_model // cfg.n_head
        p = next(model.parameters())
        shape = (cfg.n_layer, batch, cfg.n_head, self.max_len, hd)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.pos = 0
        self.last = torch.zeros(batch, dtype=torch.long, device=p.device)  # token before the next one
        # Quantize the weights once per rollout, as an engine loads quantized checkpoints.
        with torch.no_grad():
            self.weights = model.engine_weights(precision)


class _Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        d = cfg.d_model
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.out = nn.Linear(cfg.mlp_ratio * d, d)


_LINEARS = ("qkv", "proj", "fc", "out")


class TinyLM(nn.Module):
    """The causal transformer. ``forward(idx, precision)`` -> logits ``(B, L, V)``;
    ``step(tokens, cache)`` -> logits ``(B, V)`` of the next position."""

    def __init__(self, cfg: TinyLMConfig, *, generator: torch.Generator | None = None):
        """``generator``: the random stream of the initialisation (a CPU generator); ``None`` draws
        from torch's global generator, as ``nn.Module`` constructors do.

        ``TinyLM(cfg, generator=torch.Generator().manual_seed(s))`` has exactly the weights of
        ``torch.manual_seed(s); TinyLM(cfg)`` (tested) and leaves the global generator untouched:
        the layers are built on the meta device, and the first pass of :meth:`_init_weights` draws
        what their own default initialisation would have drawn, so the stream, and the weights of
        cached base policies keyed by their config, stay what they were.
        """
        super().__init__()
        self.cfg = cfg
        device = generator.device if generator is not None else torch.get_default_device()
        with torch.device("meta"):  # no draws here: every parameter is drawn in _init_weights
            self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
            self.shift = nn.Embedding(cfg.vocab_size, cfg.d_model) if cfg.token_shift else None
            self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.to_empty(device=device)
        self._init_weights(generator)

    @torch.no_grad()
    def _init_weights(self, g: torch.Generator | None) -> None:
        cfg = self.cfg
        leaves = [m for m in self.modules() if isinstance(m, nn.Linear | nn.Embedding | nn.LayerNorm)]
        for m in leaves:  # 1. the layers' default init (nn.Linear / nn.Embedding.reset_parameters)
            if isinstance(m, nn.Linear):
                nn.init.kaiming_uniform_(m.weight, a=math.sqrt(5), generator=g)
                if m.bias is not None:
                    bound = 1 / math.sqrt(m.in_features)
                    nn.init.uniform_(m.bias, -bound, bound, generator=g)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, generator=g)
            else:
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for m in leaves:  # 2. GPT-2 init, in the order of Module.apply
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02, generator=g)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        if cfg.tie_embeddings:  # as nanoGPT; also what makes copying ids from the context easy to learn
            self.head.weight = self.tok.weight
        for blk in self.blocks:  # GPT-2 scaled init of residual projections
            for lin in (blk.proj, blk.out):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layer), generator=g)

    # -- quantized pieces ------------------------------------------------------------------------

    def engine_weights(self, precision: str) -> list[dict[str, torch.Tensor]]:
        """Per block, the (fake-)quantized weight of each linear layer for ``precision``."""
        precision = EngineFormat.parse(precision)
        return [{n: quant_weight(getattr(blk, n).weight, precision, block=self.cfg.fp8_block)
                 for n in _LINEARS} for blk in self.blocks]

    @staticmethod
    def _linear(x: torch.Tensor, lin: nn.Linear, w: torch.Tensor, precision: str,
                engine: bool) -> torch.Tensor:
        y = F.linear(quant_act(x, precision), w, lin.bias)
        # bf16 runs everything in bf16; the 8-bit and 4-bit engines' GEMMs also write bf16 outputs, a
        # detail of the engine that a QAT learner (fake-quantizing weights, activations and KV) does
        # not copy.
        if precision == "bf16" or (engine and precision.quantized):
            return quant_bf16(y)
        return y

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        # q: (B, H, Lq, hd); k, v: (B, H, Lk, hd); causal: the last Lq keys are the queries' own positions.
        # PyTorch's fused kernel (the softmax(q k^T / sqrt(hd)) v of nanoGPT without its (Lq, Lk) score
        # tensor): 2.8x the explicit form on the full forward at L = 330, equal up to float rounding
        if not causal:
            return F.scaled_dot_product_attention(q, k, v)
        return _attend(q, k, v)

    def _block(self, blk: _Block, w: dict[str, torch.Tensor], x: torch.Tensor, precision: str,
               cache: KVCache | None, layer: int) -> torch.Tensor:
        B, L, D = x.size()
        H = self.cfg.n_head
        eng = cache is not None and not cache.exact
        qkv = self._linear(blk.ln1(x), blk.qkv, w["qkv"], precision, eng)  # (B, L, 3D)
        q, k, v = qkv.split(D, dim=-1)
        q, k, v = (t.view(B, L, H, D // H).transpose(1, 2) for t in (q, k, v))  # (B, H, L, hd)
        k, v = quant_kv(k, precision), quant_kv(v, precision)
        if cache is None:
            y = self._attend(q, k, v, causal=True)
        else:
            p = cache.pos
            cache.k[layer, :, :, p:p + L] = k
            cache.v[layer, :, :, p:p + L] = v
            y = self._attend(q, cache.k[layer, :, :, :p + L], cache.v[layer, :, :, :p + L], causal=True)
        y = y.transpose(1, 2).reshape(B, L, D)
        x = x + self._linear(y, blk.proj, w["proj"], precision, eng)
        h = F.gelu(self._linear(blk.ln2(x), blk.fc, w["fc"], precision, eng))
        return x + self._linear(h, blk.out, w["out"], precision, eng)

    # -- public ----------------------------------------------------------------------------------

    def forward(self, idx: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
        """Full-sequence logits ``(B, L, V)`` of token ids ``idx`` ``(B, L)``.

        With ``precision != "fp32"`` and gradients on, this is the quantization-aware learner
        (straight-through gradients through every fake-quantizer).
        """
        if idx.dim() != 2:
            raise InputError(f"idx: expected shape (B, L), got {tuple(idx.shape)}")
        B, L = idx.size()
        if L > self.cfg.max_len:
            raise InputError(f"idx: length {L} exceeds max_len {self.cfg.max_len}")
        x = self.tok(idx) + self.pos(torch.arange(L, device=idx.device))
        if self.shift is not None:  # previous token (id 0 before the first position)
            x = x + self.shift(torch.cat([torch.zeros_like(idx[:, :1]), idx[:, :-1]], dim=1))
        precision = EngineFormat.parse(precision)
        weights = self.engine_weights(precision)
        for i, blk in enumerate(self.blocks):
            x = self._block(blk, weights[i], x, precision, None, i)
        return self.head(self.ln_f(x))

    def init_cache(self, batch: int, precision: str = "fp32", max_len: int | None = None,
                   exact: bool = False) -> KVCache:
        """The rollout engine's cache. ``exact``: the engine computes as the learner does (its quantized GEMMs
        keep fp32 outputs instead of writing bf16), so it samples from the learner's own distribution up to
        the summation order of incremental decoding (the known-answer sampler of the mismatch lab)."""
        return KVCache(self, batch, precision, max_len, exact)

    def step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Feed ``tokens`` ``(B,)`` or a block ``(B, n)`` at the cache position; returns the logits of the
        last fed position ``(B, V)`` and advances the cache."""
        if tokens.dim() == 1:
            tokens = tokens[:, None]
        B, n = tokens.size()
        if cache.pos + n > cache.max_len:
            raise InputError(f"tokens: cache is full ({cache.max_len} positions)")
        x = self.tok(tokens) + self.pos(torch.arange(cache.pos, cache.pos + n, device=tokens.device))
        if self.shift is not None:
            x = x + self.shift(torch.cat([cache.last[:, None], tokens[:, :-1]], dim=1))
        cache.last = tokens[:, -1].clone()
        for i, blk in enumerate(self.blocks):
            x = self._block(blk, cache.weights[i], x, cache.precision, cache, i)
        cache.pos += n
        return self.head(self.ln_f(x[:, -1]))


# ------------------------------------------------------------------------------------------------
# M models as one program
# ------------------------------------------------------------------------------------------------


def _per_model(precision: str | Sequence[str], M: int) -> tuple[EngineFormat, ...]:
    prec = (precision,) * M if isinstance(precision, str) else tuple(precision)
    if len(prec) != M:
        raise ConfigError("precision", f"expected one precision per model ({M}), got {len(prec)}")
    return tuple(EngineFormat.parse(p) for p in prec)


def _mixed(x: torch.Tensor, prec: tuple[str, ...], fn: Callable[[torch.Tensor, str], torch.Tensor]) -> torch.Tensor:
    """``fn(x[m], prec[m])`` for every model ``m`` of the leading dimension: one call per run of
    consecutive models with the same precision (stack models grouped by precision to keep it at one
    call per precision)."""
    runs, start = [], 0
    for m in range(1, len(prec) + 1):
        if m == len(prec) or prec[m] != prec[start]:
            runs.append((start, m, prec[start]))
            start = m
    if len(runs) == 1:
        return fn(x, prec[0])
    # split, not slices: its backward is one concatenation of the gradients, where each slice's
    # backward zero-fills a tensor of the whole stack
    parts = x.split([b - a for a, b, _ in runs])
    return torch.cat([fn(t, p) for t, (_, _, p) in zip(parts, runs, strict=True)])


class StackedKVCache:
    """The KV cache of a :class:`StackedTinyLM`: keys and values ``(n_layer, M * B, H, max_len,
    head_dim)`` and the engine's quantized weights; all ``M * B`` sequences advance together."""

    def __init__(self, model: StackedTinyLM, batch: int, precision: str | Sequence[str],
                 max_len: int | None = None, exact: bool = False):
        cfg = model.cfg
        self.precision = _per_model(precision, model.n_models)
        self.exact = bool(exact)
        self.max_len = int(max_len or cfg.max_len)
        if self.max_len > cfg.max_len:
            raise ConfigError("max_len", f"{self.max_len} exceeds the model's max_len {cfg.max_len}")
        hd = cfg.d_model // cfg.n_head
        p = model.param("tok.weight")
        shape = (cfg.n_layer, model.n_models * batch, cfg.n_head, self.max_len, hd)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.pos = 0
        self.last = torch.zeros(model.n_models, batch, dtype=torch.long, device=p.device)
        with torch.no_grad():
            self.weights = model.engine_weights(self.precision)


class StackedTinyLM(nn.Module):
    """``M`` :class:`TinyLM` of one configuration run as one tensor program, as the coverage lab
    batches its seeds: every parameter is stacked on a leading model dimension, ``forward(idx)``
    takes ``idx`` ``(M, B, L)`` and returns logits ``(M, B, L, V)``, ``step(tokens, cache)`` takes
    ``(M, B)`` or ``(M, B, n)``.

    The arithmetic is the one of :class:`TinyLM` (batched matrix products instead of one per model,
    so results agree to float rounding; tested), with one precision per model: an fp32 learner and
    quantization-aware ones can share a stack. Each model keeps its own parameters, so the gradient
    of a sum of per-model losses reaches each model from its own loss alone, and an element-wise
    optimizer (AdamW) on the stack is the optimizer of each model; clip gradients per model with
    :meth:`clip_grad_norm_`.
    """

    def __init__(self, models: Sequence[TinyLM]):
        super().__init__()
        if not models:
            raise ConfigError("models", "needs at least one model")
        self.cfg = models[0].cfg
        if any(m.cfg != self.cfg for m in models):
            raise ConfigError("models", "every stacked model must have the same TinyLMConfig")
        self.n_models = len(models)
        named = [dict(m.named_parameters()) for m in models]  # the tied head is listed once, as tok.weight
        self._names = tuple(named[0])
        self.stack = nn.ParameterDict({n.replace(".", "__"): nn.Parameter(torch.stack([d[n].detach() for d in named]))
                                       for n in self._names})

    def param(self, name: str) -> torch.Tensor:
        """The stacked parameter ``(M, ...)`` of the TinyLM parameter ``name`` (e.g. ``blocks.0.qkv.weight``)."""
        return self.stack[name.replace(".", "__")]

    def unstack(self, i: int) -> TinyLM:
        """Model ``i`` as a :class:`TinyLM` (a copy of its current weights)."""
        model = TinyLM(self.cfg, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            params = dict(model.named_parameters())
            for n in self._names:
                params[n].copy_(self.param(n)[i])
        return model.eval()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip each model's gradient to global norm ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``
        does for one model); returns the ``(M,)`` norms before clipping."""
        grads = [p.grad for p in self.stack.values() if p.grad is not None]
        if not grads:
            return torch.zeros(self.n_models)
        sq = torch.stack([g.detach().pow(2).reshape(self.n_models, -1).sum(1) for g in grads]).sum(0)
        norms = sq.sqrt()
        coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))
        return norms

    # -- pieces ------------------------------------------------------------------------------------

    def engine_weights(self, precision: str | Sequence[str]) -> list[dict[str, torch.Tensor]]:
        """Per block, the stacked (fake-)quantized weight ``(M, out, in)`` of each linear layer."""
        prec = _per_model(precision, self.n_models)
        block = self.cfg.fp8_block
        return [{n: _mixed(self.param(f"blocks.{i}.{n}.weight"), prec,
                           lambda w, p: quant_weight(w, p, block=block)) for n in _LINEARS}
                for i in range(self.cfg.n_layer)]

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        M = x.size(0)
        shape = (M,) + (1,) * (x.dim() - 2) + (x.size(-1),)
        y = F.layer_norm(x, (x.size(-1),), eps=1e-5)
        return y * self.param(f"{name}.weight").view(shape) + self.param(f"{name}.bias").view(shape)

    def _linear(self, x: torch.Tensor, layer: str, w: torch.Tensor, prec: tuple[str, ...], engine: bool
                ) -> torch.Tensor:
        M, B, L, _ = x.shape
        xq = _mixed(x, prec, quant_act)
        y = torch.baddbmm(self.param(f"{layer}.bias")[:, None, :], xq.reshape(M, B * L, -1), w.transpose(1, 2))
        y = y.view(M, B, L, -1)
        if any(p == "bf16" or (engine and p.quantized) for p in prec):  # as TinyLM._linear
            y = _mixed(y, prec, lambda t, p: quant_bf16(t) if p == "bf16" or (engine and p.quantized) else t)
        return y

    def _block(self, i: int, w: dict[str, torch.Tensor], x: torch.Tensor, prec: tuple[str, ...],
               cache: StackedKVCache | None) -> torch.Tensor:
        M, B, L, D = x.shape
        H = self.cfg.n_head
        eng = cache is not None and not cache.exact
        pre = f"blocks.{i}"
        qkv = self._linear(self._ln(x, f"{pre}.ln1"), f"{pre}.qkv", w["qkv"], prec, eng)  # (M, B, L, 3D)
        q = qkv[..., :D].reshape(M, B, L, H, D // H)
        # keys and values in one call: per token per head, so the same grid as one call each
        k, v = _mixed(qkv[..., D:].reshape(M, B, L, 2, H, D // H), prec, quant_kv).unbind(3)
        q, k, v = (t.reshape(M * B, L, H, D // H).transpose(1, 2) for t in (q, k, v))  # (M*B, H, L, hd)
        if cache is None:
            y = _attend(q, k, v)
        else:
            p = cache.pos
            cache.k[i, :, :, p:p + L] = k
            cache.v[i, :, :, p:p + L] = v
            y = _attend(q, cache.k[i, :, :, :p + L], cache.v[i, :, :, :p + L])
        y = y.transpose(1, 2).reshape(M, B, L, D)
        x = x + self._linear(y, f"{pre}.proj", w["proj"], prec, eng)
        h = F.gelu(self._linear(self._ln(x, f"{pre}.ln2"), f"{pre}.fc", w["fc"], prec, eng))
        return x + self._linear(h, f"{pre}.out", w["out"], prec, eng)

    def _embed(self, tokens: torch.Tensor, start: int, prev: torch.Tensor) -> torch.Tensor:
        M, B, L = tokens.shape
        V = self.cfg.vocab_size
        base = (torch.arange(M, device=tokens.device) * V).view(M, 1, 1)
        x = self.param("tok.weight").reshape(M * V, -1)[base + tokens]  # (M, B, L, D)
        x = x + self.param("pos.weight")[:, start:start + L][:, None]
        if self.cfg.token_shift:
            x = x + self.param("shift.weight").reshape(M * V, -1)[base + prev]
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        M = x.size(0)
        x = self._ln(x, "ln_f")
        w = self.param("tok.weight" if self.cfg.tie_embeddings else "head.weight")  # (M, V, D)
        return torch.bmm(x.reshape(M, -1, x.size(-1)), w.transpose(1, 2)).view(*x.shape[:-1], -1)

    # -- public ----------------------------------------------------------------------------------

    def forward(self, idx: torch.Tensor, precision: str | Sequence[str] = "fp32") -> torch.Tensor:
        """Full-sequence logits ``(M, B, L, V)`` of ``idx`` ``(M, B, L)``; ``precision``: one for all
        models or one per model (with gradients: quantization-aware, straight-through)."""
        if idx.dim() != 3 or idx.size(0) != self.n_models:
            raise InputError(f"idx: expected shape ({self.n_models}, B, L), got {tuple(idx.shape)}")
        if idx.size(2) > self.cfg.max_len:
            raise InputError(f"idx: length {idx.size(2)} exceeds max_len {self.cfg.max_len}")
        prec = _per_model(precision, self.n_models)
        prev = torch.cat([torch.zeros_like(idx[..., :1]), idx[..., :-1]], dim=-1)
        x = self._embed(idx, 0, prev)
        weights = self.engine_weights(prec)
        for i in range(self.cfg.n_layer):
            x = self._block(i, weights[i], x, prec, None)
        return self._head(x)

    def init_cache(self, batch: int, precision: str | Sequence[str] = "fp32",
                   max_len: int | None = None, exact: bool = False) -> StackedKVCache:
        """The stacked engine's cache; ``exact`` as in :meth:`TinyLM.init_cache`."""
        return StackedKVCache(self, batch, precision, max_len, exact)

    def step(self, tokens: torch.Tensor, cache: StackedKVCache) -> torch.Tensor:
        """Feed ``tokens`` ``(M, B)`` or ``(M, B, n)`` at the cache position; returns the logits of the
        last fed position ``(M, B, V)`` and advances the cache."""
        if tokens.dim() == 2:
            tokens = tokens[..., None]
        M, B, n = tokens.shape
        if cache.pos + n > cache.max_len:
            raise InputError(f"tokens: cache is full ({cache.max_len} positions)")
        prev = torch.cat([cache.last[..., None], tokens[..., :-1]], dim=-1)
        x = self._embed(tokens, cache.pos, prev)
        cache.last = tokens[..., -1].clone()
        for i in range(self.cfg.n_layer):
            x = self._block(i, cache.weights[i], x, cache.precision, cache)
        cache.pos += n
        return self._head(x[:, :, -1:])[:, :, 0]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``q`` ``(N, H, Lq, hd)`` over ``k, v`` ``(N, H, Lk, hd)`` (the last ``Lq`` keys are
    the queries' own positions): the function of :meth:`TinyLM._attend`, through PyTorch's fused
    kernel (no ``(Lq, Lk)`` score tensor is kept for a one-token decode step)."""
    Lq, Lk = q.size(-2), k.size(-2)
    if Lq == Lk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if Lq == 1:
        return F.scaled_dot_product_attention(q, k, v)
    mask = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(Lk - Lq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
