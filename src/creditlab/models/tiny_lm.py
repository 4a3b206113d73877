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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from creditlab.errors import ConfigError, InputError
from creditlab.models.quant import check_precision, quant_act, quant_bf16, quant_kv, quant_weight

__all__ = ["KVCache", "TinyLM", "TinyLMConfig"]


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

    def __init__(self, model: TinyLM, batch: int, precision: str, max_len: int | None = None):
        cfg = model.cfg
        self.precision = check_precision(precision)
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
        check_precision(precision)
        return [{n: quant_weight(getattr(blk, n).weight, precision, block=self.cfg.fp8_block)
                 for n in _LINEARS} for blk in self.blocks]

    @staticmethod
    def _linear(x: torch.Tensor, lin: nn.Linear, w: torch.Tensor, precision: str,
                engine: bool) -> torch.Tensor:
        y = F.linear(quant_act(x, precision), w, lin.bias)
        # bf16 runs everything in bf16; the 8-bit engines' GEMMs also write bf16 outputs, a detail of
        # the engine that a QAT learner (fake-quantizing weights, activations and KV) does not copy.
        if precision == "bf16" or (engine and precision in ("fp8", "int8")):
            return quant_bf16(y)
        return y

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        # q: (B, H, Lq, hd); k, v: (B, H, Lk, hd)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, H, Lq, Lk)
        if causal:
            Lq, Lk = q.size(-2), k.size(-2)
            mask = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(Lk - Lq)
            att = att.masked_fill(~mask, float("-inf"))
        return att.softmax(dim=-1) @ v  # (B, H, Lq, hd)

    def _block(self, blk: _Block, w: dict[str, torch.Tensor], x: torch.Tensor, precision: str,
               cache: KVCache | None, layer: int) -> torch.Tensor:
        B, L, D = x.size()
        H = self.cfg.n_head
        eng = cache is not None
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
        weights = self.engine_weights(precision)
        for i, blk in enumerate(self.blocks):
            x = self._block(blk, weights[i], x, precision, None, i)
        return self.head(self.ln_f(x))

    def init_cache(self, batch: int, precision: str = "fp32", max_len: int | None = None) -> KVCache:
        return KVCache(self, batch, precision, max_len)

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
