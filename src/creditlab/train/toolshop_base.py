"""The toolshop base policy: supervised warm start on noisy scripted demonstrations, and its cache.

:func:`train_base` imitates :class:`creditlab.envs.toolshop.ScriptedAgent` at noise ``cfg.noise``
(cross-entropy on the demonstrator's tokens): the imitation learns the demonstrator's mistakes too,
so RL starts from a middling success rate. It is deterministic from ``cfg.seed`` and touches no
global state: the model init and the batch order each draw from their own ``torch.Generator``
seeded with ``cfg.seed`` (the same numbers ``torch.manual_seed(cfg.seed)`` gave).

:func:`base_policy` is the cached form: safetensors files (no pickle) named by a hash of the config
in the directory the caller names; ``cache_dir=None`` trains without caching. The library reads no
environment variable: a command line resolves the directory with :func:`default_cache_dir`, e.g.
``default_cache_dir(os.environ.get("CREDITLAB_CACHE"))``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from creditlab.envs.toolshop import PAD, VOCAB, run_scripted, thought_mask, vocab_size
from creditlab.errors import ConfigError
from creditlab.models.tiny_lm import TinyLM, TinyLMConfig
from creditlab.train.toolshop_rollout import make_tasks

__all__ = ["DEMO_SEED_OFFSET", "BaseConfig", "base_policy", "default_cache_dir", "prepare_base_policy", "train_base"]

DEMO_SEED_OFFSET = 10_000_000  # base-policy demo tasks; RL and evaluation use seeds below this

_MODEL = TinyLMConfig(vocab_size=len(VOCAB))  # the model's defaults: TinyLMConfig is their one source
_MODEL_FIELDS = frozenset(f.name for f in fields(TinyLMConfig))


@dataclass(frozen=True)
class BaseConfig:
    """Supervised warm start of the base policy (deterministic from ``seed``)."""

    chain_lengths: tuple[int, ...] = (4,)
    """Chain lengths of the demonstration tasks (each task draws one)."""
    noise: float = 0.2
    """Demonstrator noise: probability of a wrong choice at each selection (see ScriptedAgent)."""
    n_demos: int = 4000
    """Demonstration episodes (tasks seeded from ``seed``, disjoint from RL task seeds)."""
    steps: int = 1000
    """Optimizer steps."""
    batch_size: int = 128
    """Demonstrations per step."""
    lr: float = 3e-3
    """AdamW peak learning rate (linear warm-up over 5% of steps, cosine decay)."""
    n_layer: int = _MODEL.n_layer
    """Transformer blocks (:attr:`TinyLMConfig.n_layer`, and its default)."""
    n_head: int = _MODEL.n_head
    """Attention heads (:attr:`TinyLMConfig.n_head`, and its default)."""
    d_model: int = _MODEL.d_model
    """Model width (:attr:`TinyLMConfig.d_model`, and its default)."""
    max_len: int = _MODEL.max_len
    """Model context length (:attr:`TinyLMConfig.max_len`, and its default)."""
    seed: int = 0
    """Seed of the model init, the demonstrations and the batches."""
    thoughts: int = 0
    """Thought tokens at the start of every demonstrated action, drawn uniformly from
    :data:`creditlab.envs.toolshop.THOUGHT_TOKENS` (0: none, and a vocabulary without them)."""
    privileged: float = 0.0
    """Share of the demonstrations that carry a self-distillation teacher's privileged hint, half the
    reference answer, half per-turn advice (:func:`creditlab.train.opsd.privileged_demo`), so a
    teacher built from this policy has seen its context; 0: none."""
    init: str = ""
    """The cache key of a base policy whose weights this one starts from (a longer context keeps its
    position embeddings on the first positions, the rest drawn fresh), in the same cache directory;
    empty: a fresh initialisation."""

    def model_config(self) -> TinyLMConfig:
        """The :class:`TinyLMConfig` of the policy: the toolshop vocabulary, and every field of this
        config that :class:`TinyLMConfig` has too (the rest at TinyLMConfig's defaults)."""
        shared = {f.name: getattr(self, f.name) for f in fields(self) if f.name in _MODEL_FIELDS}
        return TinyLMConfig(vocab_size=vocab_size(self.thoughts), **shared)

    def key(self) -> str:
        # the model's full config and a format version: a changed architecture never loads old weights;
        # fields added since (at their defaults) are left out, so existing cache entries keep their names
        own = {k: v for k, v in asdict(self).items() if k not in _ADDED or v != _ADDED[k]}
        blob = json.dumps({**own, "model": asdict(self.model_config()), "v": 2}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: Fields added to :class:`BaseConfig` after the cache format's version 2, with their defaults.
_ADDED = {"thoughts": 0, "privileged": 0.0, "init": ""}


def default_cache_dir(env_value: str | None = None) -> Path:
    """The base-policy cache directory a command line should use: ``env_value`` when it is set and
    not empty (the caller passes the value of its environment variable, e.g. ``CREDITLAB_CACHE``),
    else the user cache directory (``platformdirs.user_cache_dir("creditlab")``)."""
    if env_value:
        return Path(env_value)
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("creditlab"))
    except ImportError:  # pragma: no cover - platformdirs is a dependency
        return Path.home() / ".cache" / "creditlab"


def train_base(cfg: BaseConfig, progress: Callable[[int, float], None] | None = None, *,
               checkpoint: Callable[[int, TinyLM], None] | None = None, checkpoint_every: int = 0,
               init: dict[str, torch.Tensor] | None = None) -> TinyLM:
    """Train the base policy from scratch (no cache). Cross-entropy on the demonstrator's tokens.

    ``progress(k, loss)`` is called after optimizer step ``k`` (0 to ``cfg.steps - 1``);
    ``checkpoint(k, model)`` every ``checkpoint_every`` steps (e.g. to evaluate); ``init``: the
    weights to start from (``cfg.init``'s, see :func:`base_policy`)."""
    model = TinyLM(cfg.model_config(), generator=torch.Generator().manual_seed(cfg.seed))
    if init is not None:
        _start_from(model, init)
    seqs, masks = [], []
    for j in range(cfg.n_demos):
        s = DEMO_SEED_OFFSET + cfg.seed * cfg.n_demos + j
        task = make_tasks([s], cfg.chain_lengths)[0]
        if cfg.privileged:  # a share of the demonstrations carry a teacher's hint
            from creditlab.train.opsd import privileged_demo

            ids, mask = privileged_demo(task, s, cfg.noise, cfg.privileged)
        else:
            ids, mask, _ = run_scripted(task, seed=s, noise=cfg.noise, thoughts=cfg.thoughts)
        seqs.append(ids)
        masks.append(mask)
    L = min(max(len(s) for s in seqs), cfg.max_len)
    X = torch.full((cfg.n_demos, L), PAD, dtype=torch.long)
    M = torch.zeros((cfg.n_demos, L), dtype=torch.bool)
    for j, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        X[j, :len(s)] = torch.tensor(s[:L])
        M[j, :len(m)] = torch.tensor(m[:L])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, cfg.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / warm) * 0.5 * (1 + np.cos(np.pi * min(1.0, k / cfg.steps))))
    gen = torch.Generator().manual_seed(cfg.seed)
    model.train()
    for k in range(cfg.steps):
        idx = torch.randint(0, cfg.n_demos, (cfg.batch_size,), generator=gen)
        x, m = X[idx], M[idx]
        n = int(m.any(0).nonzero().max()) + 1
        x, m = x[:, :n], m[:, :n]
        logits = model(x)[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1),
                                                 reduction="none").view(x.size(0), -1)
        loss = _imitation_loss(loss, m[:, 1:], x[:, 1:], cfg.thoughts)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if progress is not None:
            progress(k, float(loss.detach()))
        if checkpoint is not None and checkpoint_every and (k + 1) % checkpoint_every == 0:
            model.eval()
            checkpoint(k + 1, model)
            model.train()
    model.eval()
    return model


def _start_from(model: TinyLM, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` into ``model``: same shapes as they are, a longer position table on its first
    rows; a weight the model lacks, or of another shape, is refused."""
    own = model.state_dict()
    with torch.no_grad():
        for name, w in weights.items():
            if name not in own:
                raise ConfigError("base.init", f"the initial weights hold {name!r}, which this model lacks")
            if own[name].shape == w.shape:
                own[name].copy_(w)
            elif name == "pos.weight" and w.shape[0] < own[name].shape[0] and w.shape[1:] == own[name].shape[1:]:
                own[name][:w.shape[0]].copy_(w)
            else:
                raise ConfigError("base.init", f"{name}: shape {tuple(w.shape)} does not fit {tuple(own[name].shape)}")


def _init_weights(cfg: BaseConfig, root: Path | None) -> dict[str, torch.Tensor] | None:
    """The weights ``cfg.init`` names, from the cache directory ``root`` (None when ``cfg.init`` is empty)."""
    if not cfg.init:
        return None
    from safetensors.torch import load_file

    path = None if root is None else root / f"toolshop-base-{cfg.init}.safetensors"
    if path is None or not path.exists():
        raise ConfigError("base.init", f"no cached base policy {cfg.init!r} in {root} to start from; build it first")
    return load_file(str(path))


def _imitation_loss(token_loss: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor, thoughts: int) -> torch.Tensor:
    """Mean cross-entropy over the demonstrator's tokens. With thoughts, the mean over the thought
    tokens plus the mean over the rest: the thoughts (most of the tokens, at an irreducible loss of
    ln 16 each) would otherwise shrink the weight of the tool calls the policy has to learn by the
    share of tokens they take (about 7x at 24 thoughts per action)."""
    if not thoughts:
        return (token_loss * mask).sum() / mask.sum()
    th = mask & thought_mask(targets)
    rest = mask & ~th
    return (token_loss * th).sum() / th.sum().clamp(min=1) + (token_loss * rest).sum() / rest.sum().clamp(min=1)


def base_policy(cfg: BaseConfig = BaseConfig(), *, cache_dir: str | os.PathLike[str] | None,
                refresh: bool = False, progress: Callable[[int, float], None] | None = None) -> TinyLM:
    """The base policy for ``cfg``: loaded from ``cache_dir`` when it holds it, else trained (and
    saved there). ``cache_dir=None``: trained every time, nothing is written.

    The file is ``toolshop-base-<cfg.key()>.safetensors`` (a hash of the config), loaded with
    safetensors (no pickle). ``refresh=True`` retrains and overwrites. ``progress(k, loss)`` is
    called after each of the ``cfg.steps`` optimizer steps when it trains (see :func:`train_base`),
    never on a cache hit; drive a progress bar with it.
    """
    from safetensors.torch import load_model, save_model

    if cache_dir is None:
        return train_base(cfg, progress, init=_init_weights(cfg, None))
    root = Path(cache_dir)
    path = root / f"toolshop-base-{cfg.key()}.safetensors"
    if path.exists() and not refresh:
        model = TinyLM(cfg.model_config(), generator=torch.Generator().manual_seed(cfg.seed))
        load_model(model, str(path))  # safetensors: no pickle; handles the tied head
        model.eval()
        return model
    model = train_base(cfg, progress, init=_init_weights(cfg, root))
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # concurrent builders never share one
    save_model(model, str(tmp), metadata={"config": json.dumps(asdict(cfg))})
    os.replace(tmp, path)
    return model


def prepare_base_policy(cfg: BaseConfig, cache_dir: str | os.PathLike[str], label: str, progress: bool = True) -> None:
    """Train and cache the base policy of ``cfg`` in ``cache_dir`` unless it is there already, with a
    progress bar titled ``label`` (a lab's ``prepare``: once in the driver, before its cells)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if (Path(cache_dir) / f"toolshop-base-{cfg.key()}.safetensors").exists():
        return
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), disable=not progress) as bar:
        task = bar.add_task("base", total=cfg.steps, loss=float("nan"))
        base_policy(cfg, cache_dir=cache_dir, progress=lambda k, loss: bar.update(task, completed=k + 1, loss=loss))
