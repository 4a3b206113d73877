"""GRPO in the bag-of-units world: the training loop of the FORK lab.

World: :class:`creditlab.envs.bagofunits.BagOfUnits` (rubric facts with known truth; a response is a
sequence of units: fact statements that are right or wrong, redundant restatements, filler). Policy:
:class:`FactPolicy`, a small permutation-equivariant network (one shared MLP scores each fact slot from
its confidence and how often it was already stated; a second scores filler and stop). Rewards: the
FORK modes of :func:`creditlab.core.precision.fork_scores` on the exact verdicts, by arm name
(:func:`reward_of`). :func:`train_bag` trains one policy with GRPO and evaluates it on a fixed batch.

Options beyond the base world: a noisy training judge (``judge_flip``: the reward is computed on
verdicts flipped with that probability, the evaluation always on the exact ones), pitfalls
(``pitfalls``: sweep actions and an absence rubric, see :mod:`creditlab.envs.bagofunits`), and an
extended evaluation (``train_bag(..., extended=True)``, :func:`evaluate_extended`): true quality,
the win rate against the initial policy's responses on the same prompts, absence-rubric
satisfaction and the noisy judge's correlation with the truth on the evaluated responses.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from creditlab.core.advantages import grpo_advantages
from creditlab.envs.bagofunits import BagOfUnits, Prompts
from creditlab.errors import ConfigError
from creditlab.train.common import generator, seed_stream

__all__ = ["REWARD_ARMS", "BagTrainConfig", "FactPolicy", "bag_stream", "eval_seed", "evaluate", "evaluate_extended",
           "init_linears", "make_env", "new_policy", "pearson", "reward_of", "rollout", "train_bag", "win_rate"]

#: Reward arms (the FORK modes of :func:`creditlab.core.precision.fork_scores`); ``f<beta>`` also works.
REWARD_ARMS = ("recall", "mean", "fork", "f2")


@dataclass(frozen=True)
class BagTrainConfig:
    """One GRPO run in the bag-of-units world."""

    updates: int = 400
    """GRPO updates."""
    prompts_per_update: int = 32
    """Prompts per update; each is sampled ``group_size`` times."""
    group_size: int = 8
    """GRPO group size."""
    lr: float = 0.01
    """Adam learning rate."""
    hidden: int = 32
    """Hidden width of the policy MLPs."""
    f_min: int = 3
    """Fewest rubric facts per prompt."""
    f_max: int = 6
    """Most rubric facts per prompt."""
    known_prob: float = 0.5
    """Probability that a fact is known (confidence 1); otherwise its confidence is U(0.05, 0.95)."""
    max_units: int = 16
    """Response length cap (units)."""
    tau: float = 0.75
    """Necessity threshold of the reward: one statement of a fact has credit 1, two restatements 1/2 each."""
    beta: float = 1.0
    """F-beta of the ``fork`` arm."""
    eval_every: int = 25
    """Updates between evaluations."""
    eval_prompts: int = 512
    """Prompts in the fixed evaluation batch (one sampled response each)."""
    lenient: bool = True
    """Judge leniency on paraphrases (lenient: restatements split the credit; False: only the first
    statement matches the rubric)."""
    judge_flip: float = 0.0
    """Probability that the training judge flips each verdict (rubric met, unit matches rubric, unit
    correct); 0: exact verdicts. The evaluation always uses the exact verdicts."""
    pitfalls: bool = False
    """Add the sweep actions and one absence rubric per prompt (``creditlab.envs.bagofunits``)."""
    pitfall_points: float = 1.0
    """Points the absence rubric subtracts when a sweep violates it (0: not in the reward's rubric)."""
    pitfall_prior: float = -3.0
    """Logit offset of every sweep action in the policy (a base policy that rarely commits pitfalls)."""
    quality_wrong: float = 1.0
    """True quality: cost of an incorrect unit (a wrong guess or a sweep), in rubric points."""
    quality_pitfall: float = 2.0
    """True quality: cost of committing the pitfall, in rubric points."""


def make_env(cfg: BagTrainConfig) -> BagOfUnits:
    """The world of ``cfg``."""
    return BagOfUnits(cfg.f_min, cfg.f_max, cfg.known_prob, cfg.max_units, lenient=cfg.lenient,
                      pitfalls=cfg.pitfalls, pitfall_points=cfg.pitfall_points)


_BAG_STREAMS = ("judge", "base", "eval_judge", "calib", "calib_judge")


def bag_stream(kind: str, *parts: int | str) -> int:
    """Seed of the random streams the noisy judge and the extended evaluation add (``kind`` one of
    ``judge`` (training verdict noise), ``base`` (the initial policy's reference responses),
    ``eval_judge`` (verdict noise on the evaluated responses), ``calib`` (prompts and samples of the
    noise calibration), ``calib_judge`` (its verdict noise)): a 63-bit hash of
    ``bag-<kind>-<parts>``, apart from every stream of :func:`creditlab.train.common.seed_stream`,
    so the draws of a run without these options do not move."""
    if kind not in _BAG_STREAMS:
        raise ConfigError("bag_stream", f"unknown stream {kind!r}; valid: {', '.join(_BAG_STREAMS)}")
    return random.Random("-".join(map(str, ("bag", kind, *parts)))).getrandbits(63)


def eval_seed(seed: int) -> int:
    """Seed of the fixed evaluation prompts of a run with ``seed`` (shared by every arm)."""
    return seed_stream("bag/eval_prompts", seed)


def new_policy(hidden: int, seed: int, sweeps: bool = False, sweep_prior: float = -3.0) -> FactPolicy:
    """A :class:`FactPolicy` initialised from ``seed`` alone (built on ``meta``, then initialised by
    :func:`init_linears`: nothing is drawn from the global generator). With ``sweeps`` (a world with
    pitfalls) the sweep head is initialised after the others, so the other weights do not move."""
    with torch.device("meta"):
        policy = FactPolicy(hidden, sweeps, sweep_prior)
    return init_linears(policy.to_empty(device="cpu"), torch.Generator().manual_seed(seed))


def reward_of(arm: str, cfg_beta: float) -> tuple[str, float]:
    """``(mode, beta)`` of an arm: the names of :data:`REWARD_ARMS`, or ``f<beta>`` (FORK with that beta)."""
    if arm == "fork":
        return "fork", cfg_beta
    if arm in REWARD_ARMS:
        return arm, 1.0
    if arm.startswith("f"):
        try:
            beta = float(arm[1:])
        except ValueError:
            beta = float("nan")
        if beta > 0:
            return "fork", beta
    raise ConfigError("arms", f"unknown arm {arm!r}; valid: {', '.join(REWARD_ARMS)} or f<beta> (e.g. f1.5)")


class FactPolicy(torch.nn.Module):
    """Permutation-equivariant policy over ``[state f for each fact slot] + [filler, stop]``.

    Fact-slot features: confidence, stated 0 / 1 / 2+ times, step / max_units. Global features
    (for filler and stop): step / max_units, share of facts not yet stated, mean and max confidence
    of the facts not yet stated, a constant. With ``sweeps`` (a world with pitfalls), a third MLP
    scores ``sweep f`` for each fact slot from its features and whether the response already holds a
    sweep, plus the constant ``sweep_prior``.
    """

    def __init__(self, hidden: int, sweeps: bool = False, sweep_prior: float = -3.0):
        super().__init__()
        self.fact = torch.nn.Sequential(torch.nn.Linear(5, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        self.glob = torch.nn.Sequential(torch.nn.Linear(5, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))
        self.sweep_prior = float(sweep_prior)
        self.sweep = (torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
                      if sweeps else None)

    def forward(self, prompts: Prompts, counts: torch.Tensor, t: int, max_units: int,
                swept: torch.Tensor | None = None) -> torch.Tensor:
        """Masked logits ``(B, A)``; ``swept (B,)`` bool (the response holds a sweep) is needed with sweeps."""
        B, F = counts.shape
        step = torch.full((B, F), t / max_units)
        cnt = counts.clamp(max=2).long()
        fact_x = torch.stack([prompts.confidence, (cnt == 0).float(), (cnt == 1).float(), (cnt == 2).float(),
                              step], dim=2)  # (B, F, 5)
        fact_logits = self.fact(fact_x).squeeze(2)  # (B, F)
        unstated = prompts.fact_mask & (counts == 0)
        n_facts = prompts.fact_mask.sum(1).clamp_min(1).float()
        n_un = unstated.sum(1).float()
        conf_un = torch.where(unstated, prompts.confidence, torch.zeros_like(prompts.confidence))
        glob_x = torch.stack([step[:, 0], n_un / n_facts, conf_un.sum(1) / n_un.clamp_min(1),
                              conf_un.max(1).values, torch.ones(B)], dim=1)  # (B, 5)
        parts = [fact_logits, self.glob(glob_x)]  # (B, F), (B, 2)
        masks = [prompts.fact_mask, torch.ones(B, 2, dtype=torch.bool)]
        if self.sweep is not None:
            if swept is None:
                raise ValueError("FactPolicy: a policy with sweeps needs swept (B,)")
            sweep_x = torch.cat([fact_x, swept[:, None, None].float().expand(B, F, 1)], dim=2)  # (B, F, 6)
            parts.append(self.sweep(sweep_x).squeeze(2) + self.sweep_prior)
            masks.append(prompts.fact_mask)
        logits = torch.cat(parts, dim=1)  # (B, A)
        return logits.masked_fill(~torch.cat(masks, dim=1), float("-inf"))


def rollout(env: BagOfUnits, policy: FactPolicy, prompts: Prompts, gen: torch.Generator):
    """Sample one response per prompt; returns (responses, summed log-prob (B,))."""
    resp = env.reset(prompts)
    logp = torch.zeros(prompts.fact_mask.shape[0])
    for t in range(env.max_units):
        if bool(resp.done.all()):
            break
        swept = (resp.sweep & resp.unit_mask).any(dim=1) if env.pitfalls else None
        logits = policy(prompts, resp.counts, t, env.max_units, swept)
        probs = torch.softmax(logits, dim=1)
        action = torch.multinomial(probs.detach(), 1, generator=gen).squeeze(1)
        lp = torch.log_softmax(logits, dim=1).gather(1, action[:, None]).squeeze(1)
        logp = logp + torch.where(resp.done.clone(), torch.zeros_like(lp), lp)
        env.step(prompts, resp, t, action, gen)
    return resp, logp


def evaluate(env: BagOfUnits, policy: FactPolicy, prompts: Prompts, seed: int, tau: float) -> dict:
    """Mean length, recall, precision, F1 and unit anatomy of one sampled response per prompt (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        resp, _ = rollout(env, policy, prompts, gen)
    fork = env.score(prompts, resp, "fork", tau, 1.0)
    parts = env.anatomy(prompts, resp)
    return {"length": float(parts["length"].mean()), "recall": float(fork.recall.mean()),
            "precision": float(fork.precision.mean()), "f1": float(fork.reward.mean()),
            **{k: float(parts[k].mean()) for k in ("necessary", "redundant", "wrong", "filler")}}


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two ``(N,)`` tensors (float64); NaN when either is constant."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    den = float((x.square().sum() * y.square().sum()).sqrt())
    return float((x * y).sum()) / den if den > 0 else float("nan")


def win_rate(q_a: torch.Tensor, q_b: torch.Tensor) -> torch.Tensor:
    """``(N,)`` per prompt: 1 where ``q_a > q_b``, 0.5 on a tie (within 1e-6), else 0."""
    tie = (q_a - q_b).abs() <= 1e-6
    return torch.where(tie, torch.full_like(q_a, 0.5), (q_a > q_b).float())


def evaluate_extended(env: BagOfUnits, policy: FactPolicy, prompts: Prompts, seed: int, cfg: BagTrainConfig,
                      base_quality: torch.Tensor, judge_seed: int) -> dict:
    """:func:`evaluate`'s keys (the same samples) plus: ``quality`` (mean true quality),
    ``win_rate`` (against ``base_quality``, the initial policy's responses to the same prompts;
    ties count half), ``absence`` (share of responses that satisfy their absence rubric),
    ``sweep`` (sweep units per response) and ``judge_r`` (Pearson r between the FORK F1 a judge
    with ``cfg.judge_flip`` gives these responses, noise from ``judge_seed``, and the exact one;
    NaN with an exact judge)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        resp, _ = rollout(env, policy, prompts, gen)
    fork = env.score(prompts, resp, "fork", cfg.tau, 1.0)
    parts = env.anatomy(prompts, resp)
    q = env.quality(prompts, resp, cfg.quality_wrong, cfg.quality_pitfall)
    r = float("nan")
    if cfg.judge_flip > 0:
        judge_gen = torch.Generator().manual_seed(judge_seed)
        noisy = env.score(prompts, resp, "fork", cfg.tau, 1.0, cfg.judge_flip, judge_gen)
        r = pearson(noisy.reward, fork.reward)
    return {"length": float(parts["length"].mean()), "recall": float(fork.recall.mean()),
            "precision": float(fork.precision.mean()), "f1": float(fork.reward.mean()),
            **{k: float(parts[k].mean()) for k in ("necessary", "redundant", "wrong", "filler", "sweep")},
            "quality": float(q.mean()), "win_rate": float(win_rate(q, base_quality).mean()),
            "absence": float(env.absence(resp).float().mean()), "judge_r": r}


def base_quality(env: BagOfUnits, cfg: BagTrainConfig, seed: int, prompts: Prompts) -> torch.Tensor:
    """``(N,)`` true quality of one response of the initial policy of ``seed`` to each prompt (the
    reference of the win rate; its own sample stream, ``bag_stream("base", seed)``)."""
    policy = new_policy(cfg.hidden, seed, cfg.pitfalls, cfg.pitfall_prior)
    with torch.no_grad():
        resp, _ = rollout(env, policy, prompts, torch.Generator().manual_seed(bag_stream("base", seed)))
    return env.quality(prompts, resp, cfg.quality_wrong, cfg.quality_pitfall)


def init_linears(module: torch.nn.Module, generator: torch.Generator) -> torch.nn.Module:
    """Initialise every ``Linear`` of ``module`` as ``torch.nn.Linear.reset_parameters`` does, from
    ``generator`` (the same numbers as under ``torch.manual_seed`` with that seed, without touching
    the global generator)."""
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5), generator=generator)
            if layer.bias is not None:
                bound = 1 / math.sqrt(layer.weight.shape[1]) if layer.weight.shape[1] > 0 else 0
                torch.nn.init.uniform_(layer.bias, -bound, bound, generator=generator)
    return module


def train_bag(arm: str, seed: int, cfg: BagTrainConfig, extended: bool = False) -> list[dict]:
    """Train one :class:`FactPolicy` with GRPO under the reward ``arm`` (:func:`reward_of`) from the
    initial weights of ``seed`` (the same in every arm: paired comparisons); one row per evaluation
    point (every ``eval_every`` updates and after the last), with the keys of :func:`evaluate`, or
    with ``extended`` those of :func:`evaluate_extended`.

    Per update: ``prompts_per_update`` prompts, each sampled ``group_size`` times; the reward of each
    response (on a noisy judge's verdicts when ``cfg.judge_flip > 0``, noise from its own stream);
    GRPO advantages within each prompt's group; the REINFORCE loss ``-mean(A_i log pi(y_i))`` on the
    summed log-prob of the response; a global gradient-norm clip of 1 and one Adam step.
    """
    env = make_env(cfg)
    policy = new_policy(cfg.hidden, seed, cfg.pitfalls, cfg.pitfall_prior)  # the same initial weights in every arm
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    train_gen = generator("bag/train", seed)
    judge_gen = torch.Generator().manual_seed(bag_stream("judge", seed))
    eval_prompts = env.sample_prompts(cfg.eval_prompts, generator("bag/eval_prompts", seed))
    base_q = base_quality(env, cfg, seed, eval_prompts) if extended else None
    mode, beta = reward_of(arm, cfg.beta)
    group_ids = torch.arange(cfg.prompts_per_update).repeat_interleave(cfg.group_size)
    rows = []
    for update in range(cfg.updates + 1):
        # --- metrics: evaluation every eval_every updates and after the last
        if update % cfg.eval_every == 0 or update == cfg.updates:
            sample = seed_stream("bag/eval_sample", seed, update)
            metrics = (evaluate_extended(env, policy, eval_prompts, sample, cfg, base_q,
                                         bag_stream("eval_judge", seed, update))
                       if extended else evaluate(env, policy, eval_prompts, sample, cfg.tau))
            rows.append({"arm": arm, "seed": seed, "update": update, **metrics})
        if update == cfg.updates:
            break
        # --- rollouts
        prompts = env.sample_prompts(cfg.prompts_per_update, train_gen).repeat(cfg.group_size)
        resp, logp = rollout(env, policy, prompts, train_gen)
        # --- scores (a noisy judge draws from its own stream: train_gen's draws do not move)
        reward = env.score(prompts, resp, mode, cfg.tau, beta, cfg.judge_flip, judge_gen).reward
        # --- advantages (no per-token weights: one summed log-prob per response)
        adv = grpo_advantages(reward, group_ids)
        # --- step: REINFORCE, one clipped Adam step
        loss = -(adv * logp).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
    return rows
