"""The toolshop base policy: supervised warm start on noisy scripted demonstrations, and its cache.

:func:`train_base` imitates :class:`creditlab.envs.toolshop.ScriptedAgent` at noise ``cfg.noise``
(cross-entropy on the demonstrator's tokens): the imitation learns the demonstrator's mistakes too,
so RL starts from a middling success rate. It is deterministic from ``cfg.seed`` and touches no
global state: the model init and the batch order each draw from their own ``torch.Generator``
seeded with ``cfg.seed`` (the same numbers ``torch.manual_seed(cfg.seed)`` gave).

:func:`base_policy` is the cached form: safetensors files (no pickle) named by a hash of the config
in the directory the caller names; ``cache_dir=None`` trains without caching. The library reads no
environment variable: a command line resolves the directory with :func:`default_cache_dir`, e.g.
``default_cache_dir(os.environ.get("CREDITLAB_CACHE"))``. A build saves its state (weights, optimizer,
schedule, batch generator) beside the cache file every half minute and a build that finds it continues
from it, with the weights an uninterrupted build gives (tested bit for bit).

Base policies whose build takes too long for a first run ship with the package (:data:`SHIPPED_DIR`,
read after the cache directory, never written): :func:`ship_base_policy` writes one there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from creditlab.envs.toolshop import PAD, VOCAB, run_scripted, thought_mask, vocab_size
from creditlab.errors import ConfigError
from creditlab.models.tiny_lm import TinyLM, TinyLMConfig
from creditlab.train.toolshop_rollout import make_tasks

__all__ = ["DEMO_SEED_OFFSET", "RESUME_EVERY_S", "SHIPPED_DIR", "BaseConfig", "BuildReport", "base_file", "base_policy",
           "default_cache_dir", "demo_loss", "prepare_base_policy", "resume_step", "ship_base_policy", "train_base"]

DEMO_SEED_OFFSET = 10_000_000  # base-policy demo tasks; RL and evaluation use seeds below this

#: Base policies shipped with the package, one ``toolshop-base-<key>.safetensors`` file per config (see
#: :func:`ship_base_policy`, which writes them, and :func:`base_file`, which finds them).
SHIPPED_DIR = Path(__file__).with_name("bases")
#: A build saves its state at most this often (seconds): an interruption loses at most this much work.
RESUME_EVERY_S = 30.0

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
               init: dict[str, torch.Tensor] | None = None, resume: str | os.PathLike[str] | None = None,
               resume_every_s: float = RESUME_EVERY_S) -> TinyLM:
    """Train the base policy from scratch (no cache). Cross-entropy on the demonstrator's tokens.

    ``progress(k, loss)`` is called after optimizer step ``k`` (0 to ``cfg.steps - 1``; a resumed
    build starts past the steps it had done); ``checkpoint(k, model)`` every ``checkpoint_every``
    steps (e.g. to evaluate); ``init``: the weights to start from (``cfg.init``'s, see
    :func:`base_policy`).

    ``resume`` (a file): the build's state (weights, optimizer, learning-rate schedule, batch
    generator, steps done) is saved there, atomically, at most every ``resume_every_s`` seconds (0:
    after every step) and when Ctrl-C stops the build (at the end of the step it is in; a second
    Ctrl-C stops at once), and a call that finds the file continues from it; the file names the config
    it was saved with, and one saved with another is refused. The batch order and the schedule are
    functions of the step, so a resumed build ends with the weights of an uninterrupted one (tested
    bit for bit). The caller removes the file once the model is saved (:func:`base_policy` does)."""
    model = TinyLM(cfg.model_config(), generator=torch.Generator().manual_seed(cfg.seed))
    if init is not None:
        _start_from(model, init)
    X, M = _demos(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, cfg.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / warm) * 0.5 * (1 + np.cos(np.pi * min(1.0, k / cfg.steps))))
    gen = torch.Generator().manual_seed(cfg.seed)
    start = 0
    if resume is not None and Path(resume).exists():
        start = _load_state(resume, cfg, model, opt, sched, gen)
    saved = time.monotonic()
    model.train()
    with _ctrl_c_at_step_end(resume is not None) as ctrl_c:
        for k in range(start, cfg.steps):
            idx = torch.randint(0, cfg.n_demos, (cfg.batch_size,), generator=gen)
            loss = _batch_loss(model, X[idx], M[idx], cfg.thoughts)
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
            due = time.monotonic() - saved >= resume_every_s
            if resume is not None and k + 1 < cfg.steps and (due or ctrl_c.pressed):
                _save_state(resume, k + 1, cfg, model, opt, sched, gen)
                saved = time.monotonic()
            if ctrl_c.pressed:
                raise KeyboardInterrupt(f"base policy build interrupted after step {k + 1} of {cfg.steps}; its "
                                        f"state is saved in {resume}: run again to continue")
    model.eval()
    return model


class _CtrlC:
    pressed = False


@contextlib.contextmanager
def _ctrl_c_at_step_end(active: bool):
    """While ``active`` (in the main thread, with Python's default Ctrl-C handler): a Ctrl-C (SIGINT)
    only marks the flag, and the loop saves its state at the end of the step and stops, so an
    interrupted build loses nothing; a second Ctrl-C stops at once."""
    flag = _CtrlC()
    if not active or threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield flag
        return

    def held(signum, frame):
        if flag.pressed:
            raise KeyboardInterrupt
        flag.pressed = True

    signal.signal(signal.SIGINT, held)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _demos(cfg: BaseConfig, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` (default: all) demonstrations of ``cfg``: token ids ``(n, L)`` padded with PAD,
    and the mask of the demonstrator's tokens (what the imitation loss scores)."""
    n = cfg.n_demos if n is None else min(n, cfg.n_demos)
    seqs, masks = [], []
    for j in range(n):
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
    X = torch.full((n, L), PAD, dtype=torch.long)
    M = torch.zeros((n, L), dtype=torch.bool)
    for j, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        X[j, :len(s)] = torch.tensor(s[:L])
        M[j, :len(m)] = torch.tensor(m[:L])
    return X, M


def _batch_loss(model: TinyLM, x: torch.Tensor, m: torch.Tensor, thoughts: int) -> torch.Tensor:
    """The imitation loss of ``model`` on demonstrations ``x`` (mask ``m``), cut to their longest."""
    n = int(m.any(0).nonzero().max()) + 1
    x, m = x[:, :n], m[:, :n]
    logits = model(x)[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1),
                                             reduction="none").view(x.size(0), -1)
    return _imitation_loss(loss, m[:, 1:], x[:, 1:], thoughts)


def _config_blob(cfg: BaseConfig) -> str:
    return json.dumps(asdict(cfg), sort_keys=True)


def _save_state(path, k: int, cfg: BaseConfig, model: TinyLM, opt, sched, gen: torch.Generator) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # never a half-written state
    torch.save({"step": k, "config": _config_blob(cfg), "model": model.state_dict(), "opt": _plain(opt.state_dict()),
                "sched": _plain(sched.state_dict()), "gen": gen.get_state()}, tmp)
    os.replace(tmp, path)


def _plain(value):
    """``value`` with numpy scalars as Python numbers (the schedule's learning rates are numpy floats,
    which a weights-only load refuses; a Python float holds the same double)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    return value.item() if isinstance(value, np.generic) else value


def _load_state(path, cfg: BaseConfig, model: TinyLM, opt, sched, gen: torch.Generator) -> int:
    state = torch.load(path, weights_only=True)
    if state.get("config") != _config_blob(cfg):
        raise ConfigError("base", f"{path} holds the state of a build of another config; remove it to start over")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    gen.set_state(state["gen"])
    return int(state["step"])


def resume_step(cfg: BaseConfig, cache_dir: str | os.PathLike[str]) -> int:
    """Optimizer steps an interrupted build of ``cfg`` in ``cache_dir`` has done (0: none to resume)."""
    path = _resume_file(cfg, Path(cache_dir))
    if not path.exists():
        return 0
    return int(torch.load(path, weights_only=True)["step"])


def _resume_file(cfg: BaseConfig, root: Path) -> Path:
    return root / f"toolshop-base-{cfg.key()}.partial.pt"


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
    """The weights ``cfg.init`` names, from the cache directory ``root`` or the package's shipped base
    policies (None when ``cfg.init`` is empty)."""
    if not cfg.init:
        return None
    from safetensors.torch import load_file

    name = f"toolshop-base-{cfg.init}.safetensors"
    path = next((d / name for d in ([root] if root is not None else []) + [SHIPPED_DIR] if (d / name).exists()),
                None)
    if path is None:
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


def base_file(cfg: BaseConfig, cache_dir: str | os.PathLike[str] | None) -> Path | None:
    """The stored base policy of ``cfg``: ``cache_dir``'s file when it is there, else the one shipped
    with the package (:data:`SHIPPED_DIR`), else None."""
    name = f"toolshop-base-{cfg.key()}.safetensors"
    for root in ([Path(cache_dir)] if cache_dir is not None else []) + [SHIPPED_DIR]:
        if (root / name).exists():
            return root / name
    return None


def base_policy(cfg: BaseConfig = BaseConfig(), *, cache_dir: str | os.PathLike[str] | None,
                refresh: bool = False, progress: Callable[[int, float], None] | None = None) -> TinyLM:
    """The base policy for ``cfg``: loaded from ``cache_dir`` when it holds it, else from the package
    when it ships one (:func:`base_file`), else trained (and saved in ``cache_dir``).
    ``cache_dir=None``: trained every time, nothing is written.

    The file is ``toolshop-base-<cfg.key()>.safetensors`` (a hash of the config), loaded with
    safetensors (no pickle). ``refresh=True`` retrains and overwrites the cache's file. A build
    saves its state beside that file as it goes (``.partial.pt``, every :data:`RESUME_EVERY_S`
    seconds) and continues from it when it finds one, so an interrupted build resumes; the state is
    removed once the model is saved. ``progress(k, loss)`` is called after each optimizer step when it
    trains (see :func:`train_base`), never on a cache hit; drive a progress bar with it.
    """
    if cache_dir is None:
        return train_base(cfg, progress, init=_init_weights(cfg, None))
    found = None if refresh else base_file(cfg, cache_dir)
    if found is not None:
        return _load(cfg, found)
    return _build(cfg, Path(cache_dir), progress, fresh=refresh)


def _build(cfg: BaseConfig, root: Path, progress: Callable[[int, float], None] | None, fresh: bool = False) -> TinyLM:
    """Train the base policy of ``cfg`` (resuming from its saved state in ``root`` unless ``fresh``)
    and save it in ``root``."""
    from safetensors.torch import save_model

    path = root / f"toolshop-base-{cfg.key()}.safetensors"
    state = _resume_file(cfg, root)
    if fresh:
        state.unlink(missing_ok=True)
    model = train_base(cfg, progress, init=_init_weights(cfg, root), resume=state, resume_every_s=RESUME_EVERY_S)
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # concurrent builders never share one
    save_model(model, str(tmp), metadata={"config": json.dumps(asdict(cfg))})
    os.replace(tmp, path)
    state.unlink(missing_ok=True)
    return model


def _load(cfg: BaseConfig, path: Path) -> TinyLM:
    from safetensors.torch import load_model

    model = TinyLM(cfg.model_config(), generator=torch.Generator().manual_seed(cfg.seed))
    load_model(model, str(path))  # safetensors: no pickle; handles the tied head
    model.eval()
    return model


def prepare_base_policy(cfg: BaseConfig, cache_dir: str | os.PathLike[str], label: str, progress: bool = True) -> None:
    """Train and cache the base policy of ``cfg`` in ``cache_dir`` unless it is stored already
    (:func:`base_file`), reporting as it goes under the title ``label`` (a lab's ``prepare``: once in
    the driver, before its cells): a progress bar with the time left on a terminal, else a line on
    stderr every 10% of the steps and at least once a minute, with the steps done, the loss and the
    time left. An interrupted build resumes from its last saved state (see :func:`base_policy`)."""
    if base_file(cfg, cache_dir) is not None:
        return
    report = BuildReport(label, cfg.steps, resume_step(cfg, cache_dir), Path(cache_dir)) if progress else None
    try:
        base_policy(cfg, cache_dir=cache_dir, progress=report)
    except KeyboardInterrupt:
        if report is not None:
            report.close()
            report.interrupted(resume_step(cfg, cache_dir))
        raise
    finally:
        if report is not None:
            report.close()


class BuildReport:
    """What a base-policy build shows, as a ``progress(k, loss)`` callback of :func:`train_base`.

    First a line naming the build (steps, the cache directory, the step it resumes from). Then, when
    ``stream`` (default stderr) is a terminal, a progress bar with the loss and the time left; else a
    line every ``every`` steps (default: a tenth of them) and at least every ``every_s`` seconds, e.g.
    ``mismatch base policy: step 300/3000 (10%), loss 1.23, 2 min 31 s so far, about 22 min 40 s
    left``. The time left is the remaining steps at this build's own rate since it (re)started."""

    def __init__(self, label: str, total: int, start: int = 0, cache_dir: Path | None = None, *, stream=None,
                 every: int | None = None, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.label, self.total, self.start = label, total, start
        self.stream = stream if stream is not None else sys.stderr
        self.every = every or max(1, total // 10)
        self.every_s, self.clock = every_s, clock
        self.t0 = self.last = clock()
        where = f" in {cache_dir}" if cache_dir is not None else ""
        what = (f"resuming at step {start}/{total}" if start else f"building: {total} optimizer steps")
        self._print(f"{label}: {what}{where} (an interrupted build resumes from its last saved state)")
        self.bar = None
        if getattr(self.stream, "isatty", lambda: False)():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(),
                                TextColumn("left"), TimeRemainingColumn(),
                                console=Console(file=self.stream))
            self.bar.start()
            self.task = self.bar.add_task("base", total=total, completed=start, loss=float("nan"))

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def line(self, k: int, loss: float, now: float) -> str:
        """The report line after step ``k`` (0-based) at ``loss``, at time ``now`` (of ``clock``)."""
        done, spent = k + 1, now - self.t0
        rate = (done - self.start) / spent if spent > 0 else math.inf
        left = (self.total - done) / rate if rate > 0 else math.inf
        return (f"{self.label}: step {done}/{self.total} ({done / self.total:.0%}), loss {loss:.3f}, "
                f"{_duration(spent)} so far, about {_duration(left)} left")

    def __call__(self, k: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=k + 1, loss=loss)
            return
        done, now = k + 1, self.clock()
        if done % self.every == 0 or done == self.total or now - self.last >= self.every_s:
            self._print(self.line(k, loss, now))
            self.last = now

    def interrupted(self, saved: int) -> None:
        """Say that the build stopped, and how many of its steps are saved (0: none yet)."""
        self._print(f"{self.label}: interrupted; {saved} of {self.total} steps are saved: run the same command "
                    "again to continue from there" if saved else f"{self.label}: interrupted before its first "
                    "saved state: a rerun starts it again")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "? s"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def demo_loss(model: TinyLM, cfg: BaseConfig, n: int = 64) -> float:
    """The imitation loss of ``model`` on the first ``n`` demonstrations of ``cfg`` (the loss
    :func:`train_base` minimises, on a fixed batch): a fingerprint of weights trained for ``cfg``."""
    X, M = _demos(cfg, n)
    with torch.no_grad():
        return float(_batch_loss(model, X, M, cfg.thoughts))


def ship_base_policy(cfg: BaseConfig, cache_dir: str | os.PathLike[str], label: str = "base policy",
                     directory: str | os.PathLike[str] = SHIPPED_DIR) -> Path:
    """Build in ``cache_dir`` (or load from there, never from the package; resumable, reported with
    :class:`BuildReport`) the base policy of ``cfg`` and write it into ``directory`` (default: the
    package's :data:`SHIPPED_DIR`) as ``toolshop-base-<cfg.key()>.safetensors``, its metadata holding
    the config and :func:`demo_loss` (tests/test_shipped_bases.py checks both against the config)."""
    from safetensors.torch import save_model

    root = Path(cache_dir)
    cached = root / f"toolshop-base-{cfg.key()}.safetensors"
    if cached.exists():  # a build of this config (never the shipped file itself)
        model = _load(cfg, cached)
    else:
        report = BuildReport(label, cfg.steps, resume_step(cfg, root), root)
        try:
            model = _build(cfg, root, report)
        finally:
            report.close()
    out = Path(directory) / f"toolshop-base-{cfg.key()}.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    save_model(model, str(tmp), metadata={"config": json.dumps(asdict(cfg)),
                                          "demo_loss": repr(demo_loss(model, cfg))})
    os.replace(tmp, out)
    return out
