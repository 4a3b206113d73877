"""The mismatch lab's per-token sample (``-e sample``): the first updates of every arm, token by token.

Per-token analyses of a run (which tokens TIS truncates or masks, how far InterQ's weight is from the global
arm's, how the log ratio splits between thoughts and calls) need the tokens, which a training cell does not keep.
This experiment keeps them for a few updates: one cell trains the run's arms at the first selected dose on seed
0 for ``sample_updates`` updates, the same stacked program as that dose's seed-0 training cell (same arms, same
configs, same draws, so its first updates are that cell's), and writes one row per policy token of every
rollout: the arm, update, row, position, turn, token, whether it is a thought, the learner's and the engine's
log-probs, the engine's entropy, the row's advantage and reward, the weight the arm applied, and the weights
TIS, InterQ and the global arm would have applied to the same token. The rows are stored with the run, so a
committed run carries its sample.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from creditlab.lab.experiment import Experiment, Tables
from creditlab.lab.protocol import Table
from creditlab.lab.runner import Cell
from creditlab.labs.mismatch.config import DOSES, LABELS, MismatchConfig

__all__ = ["COMPARED", "Sample", "sample_cell", "token_summary"]

#: The arms whose weights every sampled token carries besides its own arm's (registered correction names).
COMPARED = ("tis", "interq", "global")


def sample_cell(config: dict, dose: str, arms: list[str], updates: int, cache_dir: str) -> list[dict]:
    """``updates`` updates of ``arms`` at ``dose`` on seed 0 (the stacked program of that dose's seed-0 cell), one
    row per policy token of every rollout of every model."""
    import torch

    from creditlab.core.advantages import grpo_advantages
    from creditlab.core.correction import correction_weights, parse_correction
    from creditlab.envs.toolshop import thought_mask
    from creditlab.labs.mismatch.cells import UpdateProgress, stack_members
    from creditlab.models.tiny_lm import StackedTinyLM
    from creditlab.train.toolshop_base import base_policy
    from creditlab.train.toolshop_grpo import train_grpo_stacked

    cfg = MismatchConfig.from_dict(config)
    base = base_policy(cfg.base, cache_dir=cache_dir)
    members, configs = stack_members(cfg, dose, arms, [0])  # the stack of that dose's seed-0 cell
    configs = [replace(c, updates=updates) for c in configs]
    out: list[dict] = []

    def keep(k, m, batch, rewards, old):
        arm = members[m][0]
        pm, vm, rlp = batch.policy_mask, batch.valid_mask, batch.rollout_logprobs
        adv = grpo_advantages(rewards, batch.group_ids)
        name, params = parse_correction(configs[m].correction, "correction")
        own, _ = correction_weights(name, old, rlp, pm, vm, params=params, diagnostics=False)
        other = {c: correction_weights(c, old, rlp, pm, vm, diagnostics=False)[0] for c in COMPARED}
        b, t = torch.nonzero(pm, as_tuple=True)
        th = thought_mask(batch.tokens)
        ent = batch.entropy if batch.entropy is not None else torch.full_like(old, float("nan"))
        cols = {"row": b, "pos": t, "turn": batch.turn_ids[b, t], "token": batch.tokens[b, t], "thought": th[b, t],
                "old_logprob": old[b, t], "rollout_logprob": rlp[b, t], "entropy": ent[b, t], "advantage": adv[b],
                "reward": rewards[b], "weight": own[b, t], **{f"w_{c}": w[b, t] for c, w in other.items()}}
        frame = {n: v.detach().numpy() for n, v in cols.items()}
        frame["delta"] = (frame["old_logprob"].astype(np.float64) - frame["rollout_logprob"]).astype(np.float32)
        for i in range(len(frame["row"])):
            out.append({"arm": arm, "dose": dose, "update": k, **{n: v[i].item() for n, v in frame.items()}})

    stack = StackedTinyLM([base] * len(members))
    label = f"mismatch sample {dose} seed=0 ({len(members)} model(s), {updates} updates)"
    train_grpo_stacked(stack, configs, eval_precision="fp32", on_rollouts=keep,
                       on_update=UpdateProgress(label, updates))
    return out


def token_summary(sample: pd.DataFrame) -> pd.DataFrame:
    """Per arm (over its sampled tokens): the tokens, the share that are thoughts, the share with ``delta < -1``
    and the share of calls among those, the mean TIS and InterQ weight on them, the share TIS truncates at its
    cap (ratio above 2), the arm's own mean ``|w - 1|``, and the mean ``|w_interq - w_global|`` against the mean
    ``|w_interq - 1|``."""
    rows = []
    for arm, g in sample.groupby("arm", sort=False):
        low = g[g["delta"] < -1.0]
        rows.append({"arm": arm, "tokens": len(g), "thought_share": float(g["thought"].mean()),
                     "delta_below_-1": float((g["delta"] < -1.0).mean()),
                     "calls_among_them": float((~low["thought"].astype(bool)).mean()) if len(low) else np.nan,
                     "w_tis_there": float(low["w_tis"].mean()) if len(low) else np.nan,
                     "w_interq_there": float(low["w_interq"].mean()) if len(low) else np.nan,
                     "tis_capped": float((g["delta"] > np.log(2.0)).mean()),
                     "mean_abs_w1": float((g["weight"] - 1).abs().mean()),
                     "interq_vs_global": float((g["w_interq"] - g["w_global"]).abs().mean()),
                     "interq_abs_w1": float((g["w_interq"] - 1).abs().mean())})
    return pd.DataFrame(rows)


class Sample(Experiment):
    """The per-token sample (module docstring)."""

    name = "sample"
    fields = ("sample_updates",)

    def validate(self, cfg: MismatchConfig) -> None:
        from creditlab.errors import ConfigError
        from creditlab.lab.protocol import check_count

        check_count(cfg.sample_updates, "sample_updates")
        if "sample" in cfg.experiments and self.dose(cfg) is None:
            raise ConfigError("--experiment", "sample takes the first updates of the arms at a dose: select one too "
                                              f"(e.g. -e sample -e mxfp4; doses: {', '.join(DOSES)})")

    @staticmethod
    def dose(cfg: MismatchConfig) -> str | None:
        """The dose sampled: the first dose the run selects (None: it selects none)."""
        return next((e for e in cfg.experiments if e in DOSES), None)

    def cells(self, cfg: MismatchConfig) -> list[Cell]:
        dose = self.dose(cfg)
        arms = [a for a in cfg.arms if a != "fp32"]
        if dose is None or not arms:
            return []
        return [Cell("sample", dose, sample_cell, {"config": cfg.identity(), "dose": dose, "arms": arms,
                                                   "updates": cfg.sample_updates}, cfg.context())]

    def tables(self, rows: dict[str, pd.DataFrame], cfg: MismatchConfig) -> dict[str, Table]:
        if "sample" not in rows:
            return {}
        s = rows["sample"]
        return {"token_sample": Table(s.reset_index(drop=True), "Every policy token of the sampled updates", ".4g",
                                      report=False),
                "token_summary": Table(token_summary(s), "Per-token sample: where each arm's weights act", ".3g")}

    def interpret(self, tabs: Tables, cfg: MismatchConfig) -> dict[str, str]:
        if "token_summary" not in tabs:
            return {}
        t = tabs["token_summary"].frame
        parts = []
        for _, r in t.iterrows():
            parts.append(
                f"{LABELS.get(r['arm'], r['arm'])}: {r['delta_below_-1']:.2%} of {int(r['tokens'])} tokens have "
                f"delta < -1 ({r['calls_among_them']:.0%} of them calls), TIS weighs them {r['w_tis_there']:.2f} and "
                f"InterQ {r['w_interq_there']:.2f} on average; |w_interq - w_global| {r['interq_vs_global']:.3g} "
                f"against |w_interq - 1| {r['interq_abs_w1']:.3g}")
        return {"token_summary": (f"The first {cfg.sample_updates} updates of seed 0 at {self.dose(cfg)}, every policy "
                                  "token (the token_sample table, not in the report). " + "; ".join(parts) + ".")}


EXPERIMENT = Sample()
