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
    old = torch.randn(B, L, generator=g) * 0.5 - 1.5
    rollout = old - torch.randn(B, L, generator=g) * mismatch
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
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                      eos_token_id=1, bos_token_id=None)
    return LlamaForCausalLM(cfg)
