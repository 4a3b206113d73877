"""One point of the transfer run's gate, turn by turn: how many trajectories reach each turn, and the RMS prefix
log ratio there (``mismatch.prefix_drift``'s statistic reads the last turn at which the rows *together* hold 20+
usable tokens, however few trajectories reach it).

    python scripts/transfer_gate_by_turn.py --world thoughts40 --point naive@fp8

Recomputes the gate's batch exactly as ``transfer_gate_cell`` does (the world's base policy from
``--cache``, the held-out tasks, the engine's rollouts with seed 0, the learner's log-probs), checks that its
``total`` equals the committed ``transfer_gate`` table's, and prints one line per turn, then the largest
per-trajectory RMS at each trajectory's own last turn. A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "results" / "mismatch-transfer" / "run"


def by_turn(world: str, point: str, cache: str, run: Path = RUN) -> tuple[pd.DataFrame, float, torch.Tensor]:
    """(rows, tokens, prefix RMS per turn; the check's total; each trajectory's RMS at its own last turn)."""
    from creditlab.core.diagnostics import batch_check_values
    from creditlab.diagnose.checks import CHECK_PARAMS
    from creditlab.labs.mismatch.config import MismatchConfig, arm_triple
    from creditlab.labs.mismatch.transfer import TRANSFER_WORLDS, _grpo, parse_point
    from creditlab.train.toolshop_base import base_policy
    from creditlab.train.toolshop_rollout import EVAL_SEED_OFFSET, make_tasks, rollout, sequence_logprobs

    torch.set_num_threads(1)  # as the lab's cells run: one thread, so the sums are the cell's to the last bit
    lab = json.loads((run / "lab.json").read_text(encoding="utf-8"))
    cfg = MismatchConfig.from_dict(lab["config"])
    w = TRANSFER_WORLDS[world]
    g = _grpo(cfg, w)
    arm, dose = parse_point(point)
    engine, learner, _ = arm_triple(arm, dose)
    tasks = cfg.transfer_tasks  # the gate cell's
    model = base_policy(w.base, cache_dir=cache)
    ts = make_tasks(range(EVAL_SEED_OFFSET, EVAL_SEED_OFFSET + tasks), g.chain_lengths)
    with torch.no_grad():
        b = rollout(model, ts, precision=engine, max_len=g.max_len, max_turns=g.max_turns,
                    max_action_len=g.max_action_len, temperature=g.temperature,
                    generator=torch.Generator().manual_seed(0))
        old = sequence_logprobs(model, b.tokens, learner, g.temperature)
    total = float(batch_check_values(old, b.rollout_logprobs, b.policy_mask, CHECK_PARAMS)["mismatch/prefix_drift"])
    pm = b.policy_mask.bool()
    prefix = torch.where(pm, old.double() - b.rollout_logprobs.double(), torch.zeros((), dtype=torch.float64)).cumsum(1)
    tid = torch.where(pm, b.turn_ids, torch.full_like(b.turn_ids, -1))
    rows = []
    for k in range(int(tid.max()) + 1):
        m = tid == k
        rows.append({"turn": k, "trajectories": int(m.any(1).sum()), "tokens": int(m.sum()),
                     "prefix_rms": float(prefix[m].pow(2).mean().sqrt()) if m.any() else math.nan})
    last = tid.max(1).values
    own = torch.stack([prefix[i][tid[i] == last[i]].pow(2).mean().sqrt() for i in range(prefix.shape[0])])
    return pd.DataFrame(rows), total, own


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", required=True, help="thoughts40 or thoughts24")
    ap.add_argument("--point", required=True, help="arm@dose, e.g. naive@fp8")
    ap.add_argument("--cache", default=str(ROOT / "results" / "mismatch-2core"),
                    help="directory holding the world's base policy (default: results/mismatch-2core, the "
                         "thoughts40 base; the thoughts24 base is the shipped one, built or read from "
                         "CREDITLAB_CACHE)")
    args = ap.parse_args(argv)
    table, total, own = by_turn(args.world, args.point, args.cache)
    gate = pd.read_parquet(RUN / "transfer_gate.parquet")
    arm, dose = args.point.split("@")
    want = float(gate.query("world == @args.world and arm == @arm and dose == @dose")["total"].iloc[0])
    print(table.to_string(index=False))
    top = torch.topk(own, min(3, own.numel())).values.tolist()
    print(f"check's total {total:.6g} (committed gate: {want:.6g}); per trajectory at its own last turn: median "
          f"{float(own.median()):.3g}, largest {', '.join(f'{x:.3g}' for x in top)}")
    if not math.isclose(total, want, rel_tol=1e-9):
        print("the recomputed total differs from the committed gate's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
