"""creditlab.integrations.openrlhf against OpenRLHF 0.11.2's own code: its ``PolicyLoss`` (the correction
arms through it, against its own token TIS), its ``RemoteExperienceMaker.compute_advantages_and_returns``
(dumps and live checks written from its ``Experience`` objects, which its split/merge keep), its
``SingleTurnAgentExecutor`` loading FORK as a ``reward_func`` file, and Ray's own loader of a
``worker_process_setup_hook``.

OpenRLHF is installed from the package registry without its dependencies and loaded by path
(``openrlhf_loader.py``: its GPU stack does not install here); the tests skip with the reason where the
registry cannot be reached. Not run here, because they need that GPU stack: OpenRLHF's actor building the
loss (``PolicyModelActor``), its trainer actor running the experience maker, and a training run."""

from __future__ import annotations

import asyncio
import doctest
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from integration_helpers import agent_batch, doc_block, tiny_tokenizer
from openrlhf_loader import load_openrlhf

from creditlab.core import correction
from creditlab.diagnose import read_dump, run_checks
from creditlab.errors import ConfigError, CreditlabError
from creditlab.judge.testing import ChatServer
from host_syncs import HostSyncs

RUBRICS = [{"criterion": "aspirin water", "points": 2}, {"criterion": "rest", "points": 1}]
MODS: dict = {}  # OpenRLHF's modules, loaded by the fixture below (not at collection: it may install them)
co = PolicyLoss = Experience = Maker = None


@pytest.fixture(scope="module", autouse=True)
def _openrlhf():
    """OpenRLHF 0.11.2's own modules (skips the module where the package registry cannot be reached) and
    creditlab's integration, installed into them."""
    global co, PolicyLoss, Experience, Maker
    MODS.update(load_openrlhf())
    import creditlab.integrations.openrlhf as integration

    co = integration
    PolicyLoss = MODS["loss"].PolicyLoss
    Experience = MODS["experience"].Experience
    Maker = MODS["experience_maker"].RemoteExperienceMaker
    co.install()


#: creditlab's own arms (other tests register arms of their own, which may read the host: those are a user's)
BUILTIN_ARMS = [name for name, fn in correction.CORRECTIONS.items() if fn.__module__ == correction.__name__]


def _original_forward():
    return PolicyLoss.__dict__["forward"].__creditlab_original__


def _batch(seed=0, B=6, P=3, L=20, mismatch=0.2):
    """An OpenRLHF micro-batch: action tensors ``(B, P - 1 + L)`` (from the sequence's second token), prompt
    positions 0, the learner's log-probs 0 off the action mask (as its actor returns them), vLLM's 0 on the
    prompt and on environment feedback."""
    old, rollout, lm = agent_batch(seed, B=B, L=L, mismatch=mismatch)
    z = torch.zeros(B, P - 1)
    mask = torch.cat([z, lm], 1).bool()
    old = torch.cat([z, old * lm], 1)
    rollout = torch.cat([z, rollout], 1)
    g = torch.Generator().manual_seed(seed + 1)
    lp = (old + 0.1 * torch.randn(old.shape, generator=g) * mask).clamp(max=0)
    adv = torch.randn(B, 1, generator=g).expand_as(old) * mask
    return lp, old, rollout, mask, adv


def _loss_and_grad(loss_fn, forward, lp, old, adv, mask, rollout, **kw):
    lp = lp.detach().clone().requires_grad_(True)
    out = forward(loss_fn, lp, old, adv, action_mask=mask, rollout_log_probs=rollout, **kw)
    out[0].backward()
    return out, lp.grad


def test_doctests():
    assert doctest.testmod(co, raise_on_error=False).failed == 0


def test_install_is_the_one_line_ray_loads_as_a_worker_setup_hook():
    from ray._private.runtime_env.setup_hook import load_and_execute_setup_hook_module

    before = PolicyLoss.__dict__["forward"], Maker.__dict__["compute_advantages_and_returns"]
    assert load_and_execute_setup_hook_module("creditlab.integrations.openrlhf.install") is None  # Ray's loader
    assert (PolicyLoss.__dict__["forward"], Maker.__dict__["compute_advantages_and_returns"]) == before


@pytest.mark.parametrize("token_level_loss", [True, False])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_creditlab_tis_through_policy_loss_is_openrlhfs_own_token_tis(monkeypatch, token_level_loss, dual_clip):
    lp, old, rollout, mask, adv = _batch(1, mismatch=0.4)
    kw = {"dp_size": 2, "batch_num_tokens": float(mask.sum()) * 1.5} if token_level_loss else \
        {"dp_size": 2, "global_batch_size": 9.0}
    theirs = PolicyLoss(dual_clip=dual_clip, token_level_loss=token_level_loss, is_correction_level="token",
                        is_correction_mode="clip", is_correction_threshold=[0.0, 2.0])
    ref, ref_grad = _loss_and_grad(theirs, _original_forward(), lp, old, adv, mask, rollout, **kw)
    assert float(ref[4]) > 0  # OpenRLHF clipped some ratios at 2: the cap matters
    monkeypatch.setenv(co.CORRECTION_ENV, "tis:cap=2")
    ours = PolicyLoss(dual_clip=dual_clip, token_level_loss=token_level_loss, is_correction_level="token")
    out, grad = _loss_and_grad(ours, PolicyLoss.forward, lp, old, adv, mask, rollout, **kw)
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(grad, ref_grad)
    torch.testing.assert_close(out[2], ref[2])  # ppo_kl
    torch.testing.assert_close(out[3], ref[3])  # vllm_kl, as OpenRLHF computes it
    assert ours.is_correction_level == "token"  # restored after the call
    assert ours.creditlab_metrics["creditlab/correction/clip_rate"] > 0


def test_interq_through_policy_loss_is_the_weighted_clipped_surrogate(monkeypatch):
    from creditlab.core.losses import policy_loss

    lp, old, rollout, mask, adv = _batch(2, mismatch=0.3)
    monkeypatch.setenv(co.CORRECTION_ENV, "interq:alpha_g=0.5")
    loss_fn = PolicyLoss(is_correction_level="token")
    out, grad = _loss_and_grad(loss_fn, PolicyLoss.forward, lp, old, adv, mask, rollout)
    w, _ = correction.interq_weights(old, rollout, mask, alpha_g=0.5)
    assert bool((w[mask] != 1).any())
    lp2 = lp.detach().clone().requires_grad_(True)
    want, _ = policy_loss(lp2, old, adv, mask, weights=torch.where(mask, w, 0.0))
    want.backward()
    torch.testing.assert_close(out[0], want)
    torch.testing.assert_close(grad, lp2.grad)
    assert float(out[4]) == 0.0  # no policy token weighted 0 by InterQ
    # the rollout log-probs of non-action tokens (0.0 from OpenRLHF's executors) are never read
    junk = torch.where(mask, rollout, torch.full_like(rollout, -37.5))
    out2, grad2 = _loss_and_grad(loss_fn, PolicyLoss.forward, lp, old, adv, mask, junk)
    torch.testing.assert_close(out2[0], out[0], rtol=0, atol=0)
    torch.testing.assert_close(grad2, grad, rtol=0, atol=0)


def test_every_arm_runs_through_policy_loss_without_a_host_read(monkeypatch):
    lp, old, rollout, mask, adv = _batch(3)
    assert len(BUILTIN_ARMS) >= 8
    for arm in BUILTIN_ARMS:
        monkeypatch.setenv(co.CORRECTION_ENV, arm)
        loss_fn = PolicyLoss(is_correction_level="token")
        loss_fn(lp, old, adv, action_mask=mask, rollout_log_probs=rollout)  # the spec is parsed once, here
        with HostSyncs() as syncs:
            out = loss_fn(lp, old, adv, action_mask=mask, rollout_log_probs=rollout)
        assert syncs.creditlab == [], (arm, syncs.creditlab)
        assert math.isfinite(float(out[0])) and len(out) == 5, arm
        assert "creditlab/mismatch/k3" in loss_fn.creditlab_metrics  # read once, here


def test_unset_is_openrlhfs_own_loss_and_the_refusals_say_what_to_set(monkeypatch):
    lp, old, rollout, mask, adv = _batch(4)
    monkeypatch.delenv(co.CORRECTION_ENV, raising=False)
    for level in ("off", "token"):
        loss_fn = PolicyLoss(is_correction_level=level)
        out = loss_fn(lp, old, adv, action_mask=mask, rollout_log_probs=rollout)
        ref = _original_forward()(loss_fn, lp, old, adv, action_mask=mask, rollout_log_probs=rollout)
        torch.testing.assert_close(out[0], ref[0], rtol=0, atol=0)
    monkeypatch.setenv(co.CORRECTION_ENV, "interq")
    with pytest.raises(ConfigError, match="--algo.advantage.is_correction_level: .*set it to token"):
        PolicyLoss()(lp, old, adv, action_mask=mask, rollout_log_probs=None)
    with pytest.raises(ConfigError, match="--actor.policy_loss_type: .* needs ppo"):
        PolicyLoss(policy_loss_type="gspo", is_correction_level="token")(lp, old, adv, action_mask=mask,
                                                                         rollout_log_probs=rollout)
    monkeypatch.setenv(co.CORRECTION_ENV, "interq:alpha=0.5")
    with pytest.raises(ConfigError, match="CREDITLAB_OPENRLHF_CORRECTION: bad parameter 'alpha=0.5' for interq"):
        PolicyLoss(is_correction_level="token")(lp, old, adv, action_mask=mask, rollout_log_probs=rollout)
    with pytest.raises(ConfigError, match="unknown arm 'icepop'; valid: interq"):
        co.parse_correction("icepop")


# --------------------------------------------------------------------------------------------
# the experience maker: dumps and live checks


def _experiences(n=4, groups=3, micro=2, seed=0):
    """What OpenRLHF's experience maker hands ``compute_advantages_and_returns``: micro-batches of samples
    (``index``: the sample's position, its group ``index // n``), with the learner's and vLLM's log-probs."""
    B = n * groups
    lp, old, rollout, mask, _ = _batch(seed, B=B, mismatch=0.3)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0] + [1.0] * 4 + [0.0, 0.5, 0.5, 1.0])[:B]
    att = torch.cat([torch.ones(B, 1), (torch.cumsum(mask.flip(1), 1).flip(1) > 0).float()], 1).long()
    out = []
    for i in range(0, B, B // micro):
        s = slice(i, i + B // micro)
        out.append(Experience(sequences=torch.randint(5, 20, att[s].shape), attention_mask=att[s],
                              action_mask=mask[s], action_log_probs=old[s], rollout_log_probs=rollout[s],
                              rewards=rewards[s].clone(), kl=torch.zeros(mask[s].shape), index=list(range(i, s.stop)),
                              truncated=torch.zeros(s.stop - i, dtype=torch.bool),
                              info={"reward": rewards[s].clone(), "fork/precision": torch.full((s.stop - i,), 0.75),
                                    "fork/recall": rewards[s].clone()}))  # fork_reward's extra_logs
    return out, rewards, mask


def _maker(n):
    maker = Maker.__new__(Maker)  # as OpenRLHF's own tests build it (no Ray actor groups)
    maker.advantage_estimator = "group_norm"
    maker.kl_ctl = SimpleNamespace(value=0.0)
    args = SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=n), reward=SimpleNamespace(clip_range=None),
                           algo=SimpleNamespace(advantage=SimpleNamespace(estimator="group_norm", gamma=1.0, lambd=1.0,
                                                                          no_std_norm=False)))
    maker.strategy = SimpleNamespace(args=args)
    return maker


def test_the_experience_maker_dumps_each_batch_and_logs_the_live_checks(monkeypatch, tmp_path, caplog):
    n = 4
    monkeypatch.setenv(co.DUMP_ENV, str(tmp_path / "dump"))
    monkeypatch.delenv(co.LIVE_ENV, raising=False)
    maker = _maker(n)
    exps, rewards, mask = _experiences(n)
    with caplog.at_level(logging.WARNING, logger="creditlab.integrations"):
        out = maker.compute_advantages_and_returns(exps)  # OpenRLHF's own method, wrapped
        maker.compute_advantages_and_returns(_experiences(n, seed=1)[0])
    # OpenRLHF computed its advantages as ever (group_norm: the normalised reward on every token up to the last)
    adv = torch.cat([e.advantages.gather(1, e.action_mask.long().argmax(1, keepdim=True))[:, 0] for e in out])
    g = rewards.reshape(-1, n)
    torch.testing.assert_close(adv, ((g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + 1e-9)).reshape(-1))
    dump = read_dump(tmp_path / "dump")
    assert len(dump.reward) == 2 * len(rewards) and sorted(set(dump.step.tolist())) == [0, 1]
    first = dump.reward[dump.step == 0]
    assert first.tolist() == pytest.approx(rewards.tolist())
    assert [int(x) for x in dump.group[dump.step == 0]] == [i // n for i in range(len(rewards))]
    rows = co.dump_rows(exps, n)
    assert [r["precision"] for r in rows] == [0.75] * len(rewards) and [r["recall"] for r in rows] == rewards.tolist()
    assert sum(rows[0]["policy_mask"]) == int(mask[0].sum()) and rows[0]["logprobs_source"] == "learner"
    results = {r.id: r for r in run_checks(dump)}
    live = co.live_metrics(exps, n)
    assert live["creditlab/mismatch/k3"] > 0 and live["creditlab/baseline/degenerate_groups"] == pytest.approx(1 / 3)
    assert results["baseline.degenerate_groups"].value == pytest.approx(live["creditlab/baseline/degenerate_groups"])
    assert results["mismatch.k3"].value > 0
    # in each experience's info, one value per sample, as OpenRLHF keeps its own info["reward"]: its split and
    # merge (balance_experiences) carry them like that field (the actor logs each info entry as a metric)
    ex = MODS["experience"]
    for e in out:
        assert e.info["creditlab/mismatch/k3"].shape == e.info["reward"].shape == (e.action_mask.shape[0],)
        assert float(e.info["creditlab/mismatch/k3"][0]) == pytest.approx(live["creditlab/mismatch/k3"])
        merged = ex.make_experience_batch(ex.split_experience_batch(e))
        k3, reward = merged.info["creditlab/mismatch/k3"], merged.info["reward"]
        assert type(k3) is type(reward) and torch.tensor(k3).tolist() == pytest.approx([live["creditlab/mismatch/k3"]]
                                                                                       * len(reward))
    assert any("mismatch.k3 crossed its warn threshold at step 0" in r.message for r in caplog.records)


def test_without_the_variables_the_experience_maker_is_unchanged(monkeypatch):
    n = 4
    monkeypatch.delenv(co.DUMP_ENV, raising=False)
    monkeypatch.setenv(co.LIVE_ENV, "0")
    a = _maker(n).compute_advantages_and_returns(_experiences(n)[0])
    original = Maker.__dict__["compute_advantages_and_returns"].__creditlab_original__
    b = original(_maker(n), _experiences(n)[0])
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.advantages, y.advantages, rtol=0, atol=0)
        assert not [k for k in x.info if k.startswith("creditlab/")]


# --------------------------------------------------------------------------------------------
# FORK as the reward_func of OpenRLHF's executor


class _Engine:
    """An engine answering OpenRLHF's ``llm_engine.generate`` with fixed token ids."""

    def __init__(self, ids):
        self.ids = ids

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        out = SimpleNamespace(token_ids=list(self.ids), text="", finish_reason="stop",
                              logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in self.ids])
        return SimpleNamespace(outputs=[out])


def test_fork_is_the_reward_func_openrlhfs_executor_loads_from_a_file(tmp_path, caplog):
    tok = tiny_tokenizer()
    with ChatServer() as srv:
        path = tmp_path / "fork_reward_func.py"
        path.write_text("from creditlab.integrations.openrlhf import fork_reward\n"
                        f"reward_func = fork_reward('openai', base_url={srv.url!r}, model='judge', max_retries=0)\n")
        executor = MODS["agent"].SingleTurnAgentExecutor(remote_rm_url=str(path))  # loads the file, OpenRLHF's way
        params = SimpleNamespace(max_tokens=8, logprobs=1)

        def run(prompt, response):
            engine = _Engine(tok(response, add_special_tokens=False)["input_ids"])
            return asyncio.run(executor.execute(prompt, RUBRICS, params, 32, tok, engine))

        good = run("drink tea", " take aspirin with water . rest .")
        padded = run("drink tea", " take aspirin with water . aspirin WRONG cures cancer .")
        direct = executor.reward_func(["drink tea take aspirin with water . rest ."], ["drink tea"], [RUBRICS])
        assert good["reward"].tolist() == direct["rewards"].tolist() and float(good["reward"]) > float(padded["reward"])
        assert set(good["extra_logs"]) == {"fork/precision", "fork/recall"}
        srv.push_faults(["500"])
        with caplog.at_level(logging.INFO):
            failed = run("drink tea", " rest .")
    assert failed["reward"] is None and failed["scores"] is None  # never 0: OpenRLHF logs and keeps no reward
    with pytest.raises(CreditlabError, match="does not start with its prompt"):
        executor.reward_func(["rest ."], ["drink tea"], [RUBRICS])


# --------------------------------------------------------------------------------------------
# the snippets of docs/integrations.md


def test_doc_job_block_is_a_command_line_openrlhf_and_ray_accept():
    import json
    import re
    import shlex

    from openrlhf_loader import openrlhf_root, parse_command_line
    from ray.runtime_env.runtime_env import _merge_runtime_env

    args = shlex.split(doc_block("openrlhf-job").replace("\\\n", " "))
    assert args[:3] == ["ray", "job", "submit"]
    runtime_env = json.loads(next(a for a in args if a.startswith("--runtime-env-json="))[len("--runtime-env-json="):])
    assert runtime_env["worker_process_setup_hook"] == "creditlab.integrations.openrlhf.install"
    assert co.parse_correction(runtime_env["env_vars"][co.CORRECTION_ENV]) == ("interq", {"alpha_g": 0.5})
    src = (openrlhf_root() / "openrlhf" / "cli" / "train_ppo_ray.py").read_text()
    driver = set(re.findall(r'"([A-Z_]+)":', re.search(r'"env_vars":\s*\{(.*?)\}', src, re.S).group(1)))
    assert driver and _merge_runtime_env(runtime_env, {"env_vars": {k: "1" for k in driver}}) is not None
    i = args.index("openrlhf.cli.train_ppo_ray")
    parsed = parse_command_line(args[i + 1:])  # OpenRLHF's own parser and checks
    assert parsed["algo"]["advantage"]["is_correction_level"] == "token"
    assert parsed["data"]["label_key"] == "rubrics" and parsed["reward"]["remote_url"] == ["/data/fork_reward_func.py"]


def test_doc_reward_block_runs():
    with ChatServer() as srv:
        ns = {"JUDGE_URL": srv.url}
        exec(compile(doc_block("openrlhf-reward"), "docs/integrations.md:openrlhf-reward", "exec"), ns)
        out = ns["reward_func"](["Q: take aspirin with water . rest ."], ["Q:"], [RUBRICS])
    assert float(out["rewards"][0]) > 0
