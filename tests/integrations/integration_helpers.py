"""Shared builders for the verl / TRL integration tests: hand-built agent batches, a tiny word-level
tokenizer and a tiny randomly initialised causal LM (built from a config: nothing is downloaded)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"

# words of the tiny vocabulary: real words, so that the loopback judge (which reads content words of
# four letters or more and splits sentences at ".") can score the tiny model's outputs
WORDS = ["<pad>", "<eos>", "<unk>", "<tool>", ".", "take", "aspirin", "with", "water", "rest", "sleep", "WRONG",
         "cures", "cancer", "drink", "tea", "lemon", "honey", "fever", "cough"]


def doc_block(name: str) -> str:
    """The code block that follows ``<!-- tested: name -->`` in docs/integrations.md."""
    text = DOC.read_text()
    m = re.search(rf"<!-- tested: {re.escape(name)} -->\s*```[a-z]*\n(.*?)```", text, re.DOTALL)
    assert m, f"docs/integrations.md has no block marked 'tested: {name}'"
    return m.group(1)


def agent_batch(seed: int = 0, B: int = 6, L: int = 24, mismatch: float = 0.05, turns: int = 3):
    """A hand-built multi-turn batch in verl's layout.

    Returns ``old`` (learner log-probs, real values everywhere, as the actor computes them),
    ``rollout`` (engine log-probs: 0.0 on tool tokens, as verl's agent loop reports them) and
    ``response_mask`` (float, 1 on policy tokens, 0 on tool/observation tokens and padding).
    """
    g = torch.Generator().manual_seed(seed)
    rm = torch.zeros(B, L)
    for i in range(B):
        pos = 0
        n_turns = int(torch.randint(1, turns + 1, (1,), generator=g))
        for t in range(n_turns):
            n = int(torch.randint(1, 5, (1,), generator=g))
            rm[i, pos:pos + n] = 1
            pos += n
            if t < n_turns - 1:
                pos += int(torch.randint(1, 4, (1,), generator=g))  # tool observation
            if pos >= L - 2:
                break
    old = -(torch.randn(B, L, generator=g) * 0.5 - 1.5).abs()  # log-probs are <= 0
    rollout = -(old - torch.randn(B, L, generator=g) * mismatch).abs()
    rollout = torch.where(rm > 0, rollout, torch.zeros_like(rollout))
    return old, rollout, rm


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.2,  # peaky enough outputs that an fp8 engine visibly differs
                      pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return LlamaForCausalLM(cfg)


def make_rollout_func(tokenizer, *, precision: str = "fp8", turns: int = 2, tokens_per_turn: int = 3,
                      tool_logprob: float | None = 0.0, seed: int = 0):
    """A TRL ``rollout_func``: a multi-turn agent whose rollout engine is the trainer's model with its
    weights stored in ``precision`` (fake-quantized), so the reported log-probs differ from the
    learner's. Between turns a tool observation (``<tool> water``) is appended with ``env_mask`` 0 and
    log-prob ``tool_logprob`` (0.0 like vLLM-based agent loops; junk values must not matter). The
    per-turn score is 1 when the turn mentions "water" or "rest".
    """
    import copy

    from creditlab.models.quant import quant_weight

    vocab = tokenizer.get_vocab()
    tool = [vocab["<tool>"], vocab["water"]]
    good = {vocab["water"], vocab["rest"]}
    eos = tokenizer.eos_token_id

    def rollout_func(prompts, trainer):
        engine = copy.deepcopy(trainer.model).eval()
        with torch.no_grad():
            for p in engine.parameters():
                if p.dim() == 2:  # matrices (linear layers, embeddings); norms stay in full precision
                    p.copy_(quant_weight(p, precision))
        g = torch.Generator().manual_seed(seed + int(trainer.state.global_step))
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        assert len({len(p) for p in prompt_ids}) == 1, "this test agent batches prompts of one length"
        seq = torch.tensor(prompt_ids)  # (B, P): all rollouts advance together
        B = seq.shape[0]
        comp, lps, mask, scores = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)], \
            [[] for _ in range(B)]
        for t in range(turns):
            turn = torch.empty(B, 0, dtype=torch.long)
            for k in range(tokens_per_turn):
                with torch.no_grad():
                    logp = torch.log_softmax(engine(seq).logits[:, -1].float(), -1)  # (B, V)
                if t == turns - 1 and k == tokens_per_turn - 1:
                    tok = torch.full((B,), eos)
                else:
                    tok = torch.multinomial(logp.exp(), 1, generator=g)[:, 0]
                seq = torch.cat([seq, tok[:, None]], 1)
                turn = torch.cat([turn, tok[:, None]], 1)
                for i in range(B):
                    comp[i].append(int(tok[i])), lps[i].append(float(logp[i, tok[i]])), mask[i].append(1)
            for i in range(B):
                scores[i].append(1.0 if good & set(turn[i].tolist()) else 0.0)
            if t < turns - 1:
                seq = torch.cat([seq, torch.tensor(tool).expand(B, -1)], 1)
                for i in range(B):
                    comp[i] += tool
                    lps[i] += [tool_logprob] * len(tool)
                    mask[i] += [0] * len(tool)
        return {"prompt_ids": prompt_ids, "completion_ids": comp, "logprobs": lps, "env_mask": mask,
                "turn_scores": scores}

    return rollout_func
