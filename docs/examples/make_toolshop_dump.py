"""Write docs/examples/toolshop_fp8.jsonl: a small rollout dump from the toolshop agent.

A tiny base policy (trained here from its seed in about 10 s on 2 cores) samples 4 steps x 16 tasks
(groups of 4) with an FP8 (W8A8-KV8) rollout engine; the learner scores the same tokens in fp32.
The turns carry no process score: the verifier is the toolshop world's state diff, which sees only
the write. Log-probs are rounded to 6 decimals to keep the file small.

    python docs/examples/make_toolshop_dump.py
    creditlab diagnose docs/examples/toolshop_fp8.jsonl --out runs/diagnose-example
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from creditlab.train.toolshop_base import BaseConfig, train_base
from creditlab.train.toolshop_dump import rollout_rows
from creditlab.train.toolshop_rollout import make_tasks, rollout, sequence_logprobs

BASE = BaseConfig(chain_lengths=(2, 3), n_demos=512, steps=300, batch_size=32, d_model=48, n_layer=1, max_len=96,
                  lr=1e-2)


def main(out: Path = Path(__file__).with_name("toolshop_fp8.jsonl"), steps: int = 4, tasks: int = 16) -> Path:
    model = train_base(BASE)
    lines = []
    for s in range(steps):
        batch = rollout(model, make_tasks(range(s * tasks, (s + 1) * tasks), BASE.chain_lengths), precision="fp8",
                        max_len=96, generator=torch.Generator().manual_seed(s),
                        group_ids=[i // 4 for i in range(tasks)])
        old = sequence_logprobs(model, batch.tokens)
        for row in rollout_rows(batch, batch.success, s, logprobs=old):
            for k in ("logprobs", "rollout_logprobs"):
                row[k] = [round(v, 6) for v in row[k]]
            lines.append(json.dumps(row))
    out.write_text("\n".join(lines) + "\n")
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(main())
