"""Shared builders for the verl / TRL integration tests: hand-built agent batches, a tiny word-level
tokenizer and a tiny randomly initialised causal LM (built from a config: nothing is downloaded)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
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


ENGINE_K3_FLOOR = 1e-3
"""Least mean K3 per policy token between the test engine and the learner computed the same way (same
code, full-precision weights): below it a mismatch test could pass on an engine equal to the learner
(the fp8 engine measures about 6e-3 on the tiny model, a fp32 one 1e-14)."""


def rebuild(model, precision: str = "fp32"):
    """A separately constructed copy of ``model`` (from its config, loaded from its state dict) with its
    weight matrices fake-quantized to ``precision``.

    Not ``copy.deepcopy``: inside TRL a deep copy keeps the forward TRL patches onto the trainer's model
    (its fused LM head), which calls the original model, so a deep-copied "engine" scores with the
    learner's own weights.
    """
    from creditlab.models.quant import quant_weight

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    copy_ = type(model)(model.config)
    copy_.load_state_dict(state)
    copy_.eval()
    with torch.no_grad():
        for p in copy_.parameters():
            if p.dim() == 2:  # matrices (linear layers, embeddings); norms stay in full precision
                p.copy_(quant_weight(p, precision))
    return copy_


def sampled_logprobs(model, seq: torch.Tensor, start: int) -> torch.Tensor:
    """``(B, seq_len - start)`` log-probs ``model`` gives the tokens of ``seq`` from position ``start`` on,
    in full precision (one forward of the whole sequences, causal: the same logits as token by token)."""
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[:, start - 1:-1].float(), -1)
    return logp.gather(-1, seq[:, start:, None])[..., 0]


def make_rollout_func(tokenizer, *, precision: str | Callable[[int], str] = "fp8", turns: int = 2,
                      tokens_per_turn: int = 3,
                      tool_logprob: float | None = 0.0, seed: int = 0, missing: tuple[int, int] | None = None):
    """A TRL ``rollout_func``: a multi-turn agent whose rollout engine is a separately built copy of the
    trainer's model with its weights stored in ``precision`` (fake-quantized, :func:`rebuild`), so the
    reported log-probs differ from the learner's. Between turns a tool observation (``<tool> water``) is
    appended with ``env_mask`` 0 and log-prob ``tool_logprob`` (0.0 like vLLM-based agent loops; junk
    values must not matter). The per-turn score is 1 when the turn mentions "water" or "rest".
    ``precision`` may be a function of the trainer's global step (an engine that changes during a run).
    ``missing=(i, j)``: the engine reports no log-prob (``None``, as vLLM does for a NaN) for token ``j``
    of completion ``i``.

    Every call appends its precision to ``rollout_func.precisions`` and to ``rollout_func.engine_k3`` the
    mean K3 per policy token between the engine and the learner scored the same way (a full-precision
    rebuild of the trainer's model, same code): tests of a mismatch quantity first assert it is above
    :data:`ENGINE_K3_FLOOR` (:func:`assert_engine_differs`).
    """
    vocab = tokenizer.get_vocab()
    tool = [vocab["<tool>"], vocab["water"]]
    good = {vocab["water"], vocab["rest"]}
    eos = tokenizer.eos_token_id

    def rollout_func(prompts, trainer):
        learner = trainer.accelerator.unwrap_model(trainer.model)
        prec = precision(int(trainer.state.global_step)) if callable(precision) else precision
        rollout_func.precisions.append(prec)
        engine = rebuild(learner, prec)
        g = torch.Generator().manual_seed(seed + int(trainer.state.global_step))
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        assert len({len(p) for p in prompt_ids}) == 1, "this test agent batches prompts of one length"
        seq = torch.tensor(prompt_ids)  # (B, P): all rollouts advance together
        B, P = seq.shape
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
        # the learner scored the same way as the engine: same code, full-precision weights
        ref = sampled_logprobs(rebuild(learner), seq, P).double()
        pm = torch.tensor(mask, dtype=torch.bool)
        d = ref - torch.tensor(lps, dtype=torch.float64)
        rollout_func.engine_k3.append(float(torch.where(pm, torch.expm1(d) - d, 0.0).sum() / pm.sum()))
        if missing is not None:
            lps[missing[0]][missing[1]] = None
        return {"prompt_ids": prompt_ids, "completion_ids": comp, "logprobs": lps, "env_mask": mask,
                "turn_scores": scores}

    rollout_func.engine_k3, rollout_func.precisions = [], []
    return rollout_func


def assert_engine_differs(rollout_func, floor: float = ENGINE_K3_FLOOR) -> None:
    """The test engine really differs from the learner: K3 above ``floor`` on every rollout batch of a
    quantized engine (an fp32 engine is the learner by design)."""
    k3 = [k for k, p in zip(rollout_func.engine_k3, rollout_func.precisions, strict=True) if p != "fp32"]
    assert k3, "the rollout function never ran with a quantized engine"
    assert min(k3) > floor, (f"engine vs learner K3 {min(k3):.3g} <= {floor:g}: the engine is (nearly) the learner, "
                             "so a mismatch test would pass on zero")
