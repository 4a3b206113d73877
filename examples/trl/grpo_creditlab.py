"""GRPO with creditlab in TRL: InterQ-RL rollout correction (or token TIS), per-turn / PRM credit, the FORK
reward, live checks in TRL's logs, a rollout dump written during training, then ``creditlab diagnose`` on it.

A real run (a GPU with vLLM; one score per completion from vLLM's generation, so no per-turn credit)::

    python examples/trl/grpo_creditlab.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset data/train.jsonl \\
        --judge-url http://localhost:8000/v1 --judge-model Qwen/Qwen2.5-72B-Instruct --output-dir runs/trl-creditlab

``--dataset``: a JSONL file with ``prompt`` (a string or chat messages) and ``rubrics`` (a list of
``{"criterion": ..., "points": ...}``) per line. ``--correction tis`` runs token TIS instead of InterQ-RL.

The tiny configuration (``--tiny``) builds everything locally and runs on a CPU in well under a minute:
a 2-layer Llama with a word-level vocabulary, a ``rollout_func`` playing a two-turn tool-using agent whose
engine is an FP8 (fake-quantized) copy of the policy (so its log-probs differ from the learner's, as a
quantized vLLM engine's do), one score per turn (``turn_scores``) for PRM credit, and the FORK reward judged
by creditlab's loopback judge server unless ``--judge-url`` is given::

    python examples/trl/grpo_creditlab.py --tiny --output-dir runs/trl-tiny

Both end with ``creditlab diagnose <output-dir>/dump --out <output-dir>/diagnose`` (run in this process) and
exit with its exit code: 0 when no check fails, 1 when one does. Read ``<output-dir>/diagnose/report.md``:
``mismatch.k3`` and ``mismatch.prefix_drift`` say how far the engine is from the learner (what the
correction corrects), ``baseline.degenerate_groups`` how many groups had no reward spread (no learning
signal), ``reward.*`` whether the reward is being hacked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: the correction arms this recipe offers, with their parameters (creditlab.core.correction.CORRECTIONS)
CORRECTIONS = {"interq": {"alpha_g": 0.5}, "tis": {"cap": 2.0}}
#: PRM mixing on the turns: lambda 0.5, decaying to 0 over steps 20..30 (TRL's global step)
CREDIT_SETTINGS = {"prm_lambda": 0.5, "prm_schedule": "decay", "prm_start": 20, "prm_end": 30}
RUBRICS = [{"criterion": "aspirin water", "points": 2}, {"criterion": "rest", "points": 1}]
WORDS = ["<pad>", "<eos>", "<unk>", "<tool>", ".", "take", "aspirin", "with", "water", "rest", "sleep", "WRONG",
         "cures", "cancer", "drink", "tea", "lemon", "honey", "fever", "cough"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny local configuration (no download, CPU or GPU)")
    ap.add_argument("--model", help="model to train (a real run; vLLM generates)")
    ap.add_argument("--dataset", help="JSONL with 'prompt' and 'rubrics' (a real run)")
    ap.add_argument("--judge-url", help="OpenAI-compatible endpoint of the FORK judge (tiny: a loopback judge)")
    ap.add_argument("--judge-model", default="judge", help="the judge's model name")
    ap.add_argument("--correction", choices=sorted(CORRECTIONS), default="interq",
                    help="interq (InterQ-RL, default) or tis (token TIS)")
    ap.add_argument("--output-dir", required=True, help="checkpoints, the dump (dump/) and the report (diagnose/)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (tiny default 3, real default 200)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="tiny: default cuda when available")
    ap.add_argument("--no-diagnose", action="store_true", help="do not run creditlab diagnose at the end")
    args = ap.parse_args(argv)
    if not args.tiny and not (args.model and args.dataset and args.judge_url):
        ap.error("a real run needs --model, --dataset and --judge-url (or --tiny)")
    return args


# --------------------------------------------------------------------------------------------
# the tiny configuration: model, tokenizer, agent (all built here, nothing downloaded)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_model(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=64, initializer_range=0.2, pad_token_id=0,
                                        eos_token_id=1, bos_token_id=None))


def fp8_engine(model):
    """A separately built copy of ``model`` with its weight matrices stored in FP8 (fake-quantized): the
    rollout engine of the tiny agent."""
    import torch

    from creditlab.models.quant import quant_weight

    engine = type(model)(model.config).to(next(model.parameters()).device)
    engine.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    engine.eval()
    with torch.no_grad():
        for p in engine.parameters():
            if p.dim() == 2:
                p.copy_(quant_weight(p, "fp8"))
    return engine


def tiny_rollout_func(tokenizer, turns: int = 2, tokens_per_turn: int = 3):
    """A TRL ``rollout_func``: a two-turn agent sampling from the FP8 engine, a tool observation (``<tool>
    water``, ``env_mask`` 0, log-prob 0.0 as vLLM agent loops report it) between turns, the engine's
    log-probs of every generated token (``logprobs``: what the correction needs) and one score per turn
    (1 when the turn says "water" or "rest": the ``turn_scores`` of PRM credit)."""
    import torch

    vocab = tokenizer.get_vocab()
    tool = [vocab["<tool>"], vocab["water"]]
    good = {vocab["water"], vocab["rest"]}

    def rollout_func(prompts, trainer):
        learner = trainer.accelerator.unwrap_model(trainer.model)
        engine = fp8_engine(learner)
        dev = next(engine.parameters()).device
        g = torch.Generator(device="cpu").manual_seed(int(trainer.state.global_step))
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        seq = torch.tensor(prompt_ids, device=dev)  # the prompts have one length: the rollouts advance together
        B = seq.shape[0]
        comp, lps, mask, scores = ([[] for _ in range(B)] for _ in range(4))
        for t in range(turns):
            turn = []
            for k in range(tokens_per_turn):
                with torch.no_grad():
                    logp = torch.log_softmax(engine(seq).logits[:, -1].float(), -1).cpu()
                if t == turns - 1 and k == tokens_per_turn - 1:
                    tok = torch.full((B,), tokenizer.eos_token_id)
                else:
                    tok = torch.multinomial(logp.exp(), 1, generator=g)[:, 0]
                seq = torch.cat([seq, tok[:, None].to(dev)], 1)
                turn.append(tok)
                for i in range(B):
                    comp[i].append(int(tok[i]))
                    lps[i].append(float(logp[i, tok[i]]))
                    mask[i].append(1)
            said = torch.stack(turn, 1)
            for i in range(B):
                scores[i].append(1.0 if good & set(said[i].tolist()) else 0.0)
            if t < turns - 1:
                seq = torch.cat([seq, torch.tensor(tool, device=dev).expand(B, -1)], 1)
                for i in range(B):
                    comp[i] += tool
                    lps[i] += [0.0] * len(tool)
                    mask[i] += [0] * len(tool)
        return {"prompt_ids": prompt_ids, "completion_ids": comp, "logprobs": lps, "env_mask": mask,
                "turn_scores": scores}

    return rollout_func


# --------------------------------------------------------------------------------------------
# the run


def train(args: argparse.Namespace, judge_url: str) -> Path:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig

    from creditlab.integrations.trl import CreditlabGRPOTrainer, fork_reward

    out = Path(args.output_dir)
    dump = out / "dump"
    fork = fork_reward("openai", base_url=judge_url, model=args.judge_model)  # dataset column "rubrics"
    common = dict(output_dir=str(out / "checkpoints"), report_to="none", logging_steps=1, save_strategy="no")
    if args.tiny:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        tokenizer, model = tiny_tokenizer(), tiny_model()
        dataset = Dataset.from_dict({"prompt": ["take aspirin", "drink tea"] * 4, "rubrics": [RUBRICS] * 8})
        config = GRPOConfig(**common, per_device_train_batch_size=8, num_generations=4, max_completion_length=16,
                            max_steps=args.steps or 3, learning_rate=1e-2, use_cpu=device == "cpu",
                            disable_tqdm=True, seed=0)
        extra = dict(rollout_func=tiny_rollout_func(tokenizer), credit="prm", credit_settings=CREDIT_SETTINGS)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        rows = [json.loads(line) for line in Path(args.dataset).read_text().splitlines() if line.strip()]
        dataset = Dataset.from_list([{"prompt": r["prompt"], "rubrics": r["rubrics"]} for r in rows])
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
        config = GRPOConfig(**common, per_device_train_batch_size=8, num_generations=8, max_completion_length=1024,
                            max_steps=args.steps or 200, learning_rate=1e-6, bf16=True, use_vllm=True,
                            vllm_mode="colocate")
        extra = {}  # vLLM's completions are one turn each: no per-turn credit (a multi-turn rollout_func gives it)
    trainer = CreditlabGRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[fork], train_dataset=dataset,
                                   args=config, correction=args.correction,
                                   correction_params=CORRECTIONS[args.correction], dump=str(dump), live_checks=True,
                                   **extra)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    keep = ("step", "loss", "rewards/fork/mean", "reward/fork/precision", "creditlab/mismatch/k3",
            "creditlab/correction/clip_rate", "creditlab/baseline/degenerate_groups")
    (out / "train_log.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    for h in logs:
        print("  ".join(f"{k}={h[k]:.4g}" if isinstance(h[k], float) else f"{k}={h[k]}" for k in keep if k in h))
    return dump


def diagnose(dump: Path, report: Path) -> int:
    """``creditlab diagnose DUMP --out REPORT`` (the command, run in this process); its exit code."""
    from creditlab.cli.main import main as creditlab

    print(f"creditlab diagnose {dump} --out {report}")
    try:
        creditlab(["diagnose", str(dump), "--out", str(report), "--quiet"])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny and args.judge_url is None:
        from creditlab.judge.testing import ChatServer  # creditlab's loopback judge: no model, no network

        with ChatServer() as judge:
            dump = train(args, judge.url)
    else:
        dump = train(args, args.judge_url)
    if args.no_diagnose:
        return 0
    report = Path(args.output_dir) / "diagnose"
    code = diagnose(dump, report)
    print(f"creditlab diagnose: exit code {code}; read {report / 'report.md'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
