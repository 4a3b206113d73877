"""The ``oracle`` experiment of the fork lab: the best fixed rule per reward, no learning."""

from __future__ import annotations

import pandas as pd
import torch

from creditlab.envs.bagofunits import BagOfUnits
from creditlab.lab.experiment import Experiment
from creditlab.lab.protocol import Table
from creditlab.lab.runner import Cell
from creditlab.labs.fork.config import ForkLabConfig
from creditlab.train.bagofunits import (
    reward_of,
)
from creditlab.train.common import single_thread


def oracle_thresholds(cfg: ForkLabConfig, n_prompts: int = 2048, seed: int = 0) -> pd.DataFrame:
    """Best fixed rule "state each fact with confidence >= theta once, then stop", per reward.

    An analytic check of what each reward asks for, free of learning noise: for every theta on a
    grid, the expected reward of that rule is estimated on ``n_prompts`` prompts; the row of each
    arm is its best theta with the recall, precision and length of that rule.
    """
    with single_thread():  # small tensors: intra-op threads only add contention
        return _oracle(cfg, n_prompts, seed)


def _oracle(cfg: ForkLabConfig, n_prompts: int, seed: int) -> pd.DataFrame:
    L = min(cfg.f_max, cfg.max_units)
    env = BagOfUnits(cfg.f_min, cfg.f_max, cfg.known_prob, L, lenient=cfg.lenient)
    gen = torch.Generator().manual_seed(seed)
    prompts = env.sample_prompts(n_prompts, gen)
    right = torch.rand(prompts.confidence.shape, generator=gen) < prompts.confidence  # (B, F)
    best: dict[str, dict] = {}
    for theta in torch.linspace(0.0, 1.0, 21).tolist():
        say = prompts.fact_mask & (prompts.confidence >= theta - 1e-9)  # (B, F) one unit per stated fact
        resp = env.reset(prompts)
        resp.fact[:, :L] = torch.where(say, torch.arange(cfg.f_max)[None, :], -1)[:, :L]
        resp.correct[:, :L] = (say & right)[:, :L]
        resp.unit_mask[:, :L] = say[:, :L]
        for arm in cfg.arms:
            mode, b = reward_of(arm, cfg.beta)
            sc = env.score(prompts, resp, mode, cfg.tau, b)
            r = float(sc.reward.mean())
            if arm not in best or r > best[arm]["expected reward"] + 1e-9:
                best[arm] = {"arm": arm, "best theta": theta, "expected reward": r,
                             "recall": float(sc.recall.mean()), "precision": float(sc.precision.mean()),
                             "length": float(say.sum(1).float().mean())}
    return pd.DataFrame([best[a] for a in cfg.arms])


def run_oracle_cell(config: dict) -> list[dict]:
    """The ``oracle`` experiment as a cell: one row per reward arm (see :func:`oracle_thresholds`)."""
    return oracle_thresholds(ForkLabConfig.from_dict(config)).to_dict("records")


class Oracle(Experiment):
    """The best fixed rule 'state each fact with confidence >= theta once' per reward."""

    name = "oracle"

    def cells(self, cfg: ForkLabConfig) -> list[Cell]:
        return [Cell("oracle", "oracle", run_oracle_cell, {"config": cfg.identity()})]

    def tables(self, rows: dict[str, pd.DataFrame], cfg: ForkLabConfig) -> dict[str, Table]:
        order = {a: i for i, a in enumerate(cfg.arms)}
        o = rows["oracle"].sort_values("arm", key=lambda c: c.map(order)).reset_index(drop=True)
        return {"fork_oracle": Table(o, "Best fixed rule 'state each fact with confidence >= theta once' per "
                                        "reward (no learning)", console=True)}

    def interpret(self, tabs, cfg: ForkLabConfig) -> dict[str, str]:
        o = tabs["fork_oracle"].frame
        return {"fork_oracle": (
            "What each reward asks for without learning noise: the best confidence threshold theta for the rule "
            "'state each fact whose confidence is at least theta, once'. "
            + "; ".join(f"{r['arm']}: theta {r['best theta']:.2f}, recall {r['recall']:.2f}, precision "
                        f"{r['precision']:.2f}" for _, r in o.iterrows())
            + ". A reward that rewards guessing picks a low theta.")}


EXPERIMENT = Oracle()
