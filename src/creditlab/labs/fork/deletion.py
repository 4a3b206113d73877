"""The ``deletion`` experiment of the fork lab: the necessity check, deletion curves of the
credit-split necessity against a noisy direct necessity guess and the truth."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from creditlab.envs.bagofunits import BagOfUnits, Prompts
from creditlab.errors import ConfigError
from creditlab.lab.experiment import Experiment
from creditlab.lab.plotting import new_figure, save
from creditlab.lab.protocol import Table
from creditlab.lab.report import small_run_note, summarize
from creditlab.lab.runner import Cell
from creditlab.labs.fork.config import ForkLabConfig
from creditlab.train.bagofunits import (
    eval_seed,
    new_policy,
    rollout,
)
from creditlab.train.common import generator


def _first_statements(env: BagOfUnits, prompts: Prompts, resp) -> torch.Tensor:
    """``(B, U)`` bool: the first correct statement of each fact (the truly necessary units)."""
    f_ids = torch.arange(env.f_max)[None, :, None]
    m = (resp.fact[:, None, :] == f_ids) & resp.correct[:, None, :] & resp.unit_mask[:, None, :]
    m &= prompts.fact_mask[:, :, None]
    return (m & (torch.cumsum(m.to(torch.int32), dim=2) == 1)).any(dim=1)


def run_deletion_cell(seed: int, config: dict) -> list[dict]:
    """Necessity deletion curves on the initial policy's responses (one evaluation batch): units
    deleted in ascending order of the credit-split necessity (FORK's unit credit), of a direct
    per-unit necessity guess that is wrong with probability ``deletion_noise`` (the generic
    criteria baseline), and of the truth (the first correct statement of each fact)."""
    from creditlab.core.precision import deletion_curve, unit_credit

    cfg = ForkLabConfig.from_dict(config)
    env = BagOfUnits(cfg.f_min, cfg.f_max, cfg.known_prob, cfg.max_units, lenient=cfg.lenient)
    policy = new_policy(cfg.hidden, seed)
    prompts = env.sample_prompts(cfg.eval_prompts, torch.Generator().manual_seed(eval_seed(seed)))
    gen = generator("fork/deletion", seed)
    with torch.no_grad():
        resp, _ = rollout(env, policy, prompts, gen)
    match, _ = env.verdicts(prompts, resp)
    rubrics = prompts.fact_mask & (prompts.points > 0)
    truth = _first_statements(env, prompts, resp)
    flip = torch.rand(truth.shape, generator=gen) < cfg.deletion_noise
    jitter = 1e-3 * torch.rand(truth.shape, generator=gen)  # ties broken at random, not by position
    scores = {"credit split (FORK)": unit_credit(match, rubrics, resp.unit_mask) + jitter,
              "direct guess": (truth ^ flip).float() + jitter, "truth": truth.float() + jitter}
    rows = []
    n_units = float(resp.unit_mask.sum(1).float().mean())
    n = resp.unit_mask.sum(1)  # (B,) units per response
    fracs = torch.linspace(0, 1, 11)
    k = torch.floor(fracs[None, :] * n[:, None]).long()  # (B, 11): units deleted at each share of the response
    has = n > 0
    for name, sc in scores.items():
        curve, m = deletion_curve(match, prompts.points, rubrics, resp.unit_mask, sc)
        free = float(m["reward/fork/deletion_free_frac"])
        at = curve.gather(1, k)[has].mean(0)  # mean recall after deleting that share of each response
        rows += [{"seed": seed, "predictor": name, "deleted_share": float(f), "recall": float(v), "free_frac": free,
                  "mean_units": n_units} for f, v in zip(fracs.tolist(), at.tolist(), strict=True)]
    return rows


def _plot_deletion(curves: pd.DataFrame, out: Path) -> Path:
    fig, ax = new_figure(figsize=(7, 4.2))
    for name, g in curves.groupby("predictor", sort=False):
        ax.plot(g["deleted_share"], g["recall"], "o-", label=name, lw=1.8, ms=3)
    ax.set(xlabel="share of each response's units deleted (least necessary first)", ylabel="mean recall",
           ylim=(0, 1.05),
           title="necessity deletion curves (initial policy's responses)")
    ax.legend(fontsize=8)
    return save(fig, out / "fork_deletion.png")


class Deletion(Experiment):
    """Necessity deletion curves on the initial policy's responses."""

    name = "deletion"
    fields = ("deletion_noise",)

    def validate(self, cfg: ForkLabConfig) -> None:
        if not 0.0 <= cfg.deletion_noise <= 0.5:
            raise ConfigError("deletion_noise", f"must be in [0, 0.5], got {cfg.deletion_noise}")

    def cells(self, cfg: ForkLabConfig) -> list[Cell]:
        ident = cfg.identity()
        return [Cell("deletion", f"seed={seed}", run_deletion_cell, {"seed": seed, "config": ident})
                for seed in range(cfg.seeds)]

    def tables(self, rows: dict[str, pd.DataFrame], cfg: ForkLabConfig) -> dict[str, Table]:
        df = rows["deletion"]
        curve = Table(df.groupby(["predictor", "deleted_share"], sort=False)["recall"].mean().reset_index(),
                      "Deletion curves: mean recall after deleting a share of each response's units", report=False)
        free = df.drop_duplicates(["seed", "predictor"])
        s = summarize(free, ["predictor"], "free_frac", (0.0, 1.0))
        s["mean_units"] = float(free["mean_units"].mean())
        return {"fork_deletion_curve": curve,
                "fork_deletion": Table(s, "Necessity check: share of a response's units deleted before recall "
                                          "drops (initial policy)")}

    def plots(self, tabs, cfg: ForkLabConfig, out: Path) -> list[Path]:
        return [_plot_deletion(tabs["fork_deletion_curve"].frame, out)]

    def interpret(self, tabs, cfg: ForkLabConfig) -> dict[str, str]:
        d = tabs["fork_deletion"].frame.set_index("predictor")["mean"]
        units = tabs["fork_deletion"].frame["mean_units"].iloc[0]
        return {"fork_deletion": (
            f"Units of the initial policy's responses (mean {units:.1f} per response) deleted in ascending "
            "order of predicted necessity; free_frac is the share deleted before recall falls below its start. "
            + "; ".join(f"{p}: {v:.2f}" for p, v in d.items())
            + f". The direct guess is wrong about a unit with probability {cfg.deletion_noise:g}; 'truth' deletes "
            "every unit but the first correct statement of each fact (the ceiling)." + small_run_note(cfg.seeds))}


EXPERIMENT = Deletion()
