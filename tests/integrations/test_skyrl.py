"""creditlab.integrations.skyrl against the real SkyRL 0.3.0 package: its registries, its loss and
correction functions, its config classes and validation, its documented custom-algorithm example.

SkyRL 0.3.0's ``skyrl.backends`` package ``__init__`` imports ``skyrl.tinker.types``, which pydantic 2
refuses on Python < 3.12; on those versions the tests load ``skyrl.backends`` without running that
``__init__`` (its submodules, the registries and correction code, are SkyRL's unchanged code)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

skyrl = pytest.importorskip("skyrl", reason='SkyRL is not installed (pip install "creditlab[skyrl]")')

from skyrl_ray_worker import load_backends_without_init  # noqa: E402

load_backends_without_init()

from integration_helpers import agent_batch, doc_block  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from skyrl.backends.skyrl_train.utils import off_policy_correction_utils, ppo_utils  # noqa: E402
from skyrl.train.config import AlgorithmConfig  # noqa: E402

import creditlab.integrations.skyrl as cs  # noqa: E402
from creditlab.core import correction, credit  # noqa: E402
from creditlab.errors import ConfigError, CreditlabError  # noqa: E402

PL, AE = ppo_utils.PolicyLossRegistry, ppo_utils.AdvantageEstimatorRegistry


def _algo(**over):
    cfg = cs.CreditlabAlgorithmConfig()
    for k, v in over.items():
        obj, *path = k.split(".")
        target = cfg
        for p in [obj, *path][:-1]:
            target = getattr(target, p)
        setattr(target, [obj, *path][-1], v)
    return cfg


def _batch(seed=0, mismatch=0.2, B=6, L=20):
    old, rollout, rm = agent_batch(seed, B=B, L=L, mismatch=mismatch)
    g = torch.Generator().manual_seed(seed + 1)
    lp = (old + 0.1 * torch.randn(old.shape, generator=g)).clamp(max=0).requires_grad_(True)
    adv = torch.randn(old.shape[0], 1, generator=g).expand_as(old) * rm / rm.sum()
    return lp, old, rollout, rm, adv


def _loss_and_grad(name, cfg, lp, old, rollout, rm, adv):
    lp = lp.detach().clone().requires_grad_(True)
    loss, metrics = PL.get(name)(lp, old, adv, config=cfg, loss_mask=rm, rollout_logprobs=rollout)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def test_every_arm_and_geometry_is_in_skyrls_registries():
    losses, estimators = PL.list_available(), AE.list_available()
    assert {f"creditlab_{a}" for a in correction.CORRECTIONS} <= set(losses)
    assert {f"creditlab_{g}" for g in credit.GEOMETRIES} <= set(estimators)
    assert cs.DEFAULT_POLICY_LOSS == "creditlab_interq" in losses
    assert set(cs.POLICY_LOSSES) <= set(losses) and set(cs.ESTIMATORS) <= set(estimators)
    before = dict(PL._functions)
    cs.install()  # idempotent
    assert PL._functions == before
    # SkyRL's own repopulation (validate_cfg) keeps them
    ppo_utils.repopulate_all_registries()
    assert PL.get("creditlab_interq") is before["creditlab_interq"]


def test_a_foreign_function_under_a_creditlab_name_is_refused():
    def other(*a, **k):
        return None

    saved = PL._functions.pop("creditlab_tis")
    try:
        PL.register("creditlab_tis", other)
        with pytest.raises(CreditlabError, match="already registered"):
            cs.install()
    finally:
        PL._functions["creditlab_tis"] = saved


@pytest.mark.parametrize("skyrl_type,arm,cap_key,cap", [("token", "tis", "token_tis_ratio_clip_high", 1.5),
                                                        ("sequence", "seq_is", "sequence_tis_ratio_clip_high", 1.2)])
def test_tis_equals_skyrls_own_correction(skyrl_type, arm, cap_key, cap):
    lp, old, rollout, rm, adv = _batch()
    theirs_cfg = _algo(policy_loss_type="regular")
    theirs_cfg.off_policy_correction.tis_ratio_type = skyrl_type
    setattr(theirs_cfg.off_policy_correction, cap_key, cap)
    ours_cfg = _algo(creditlab={"correction_params": {"cap": cap}})
    l1, g1, m1 = _loss_and_grad("regular", theirs_cfg, lp, old, rollout, rm, adv)
    l2, g2, m2 = _loss_and_grad(f"creditlab_{arm}", ours_cfg, lp, old, rollout, rm, adv)
    assert torch.allclose(l1, l2.to(l1.dtype), atol=1e-6), (l1, l2)
    assert torch.allclose(g1, g2, atol=1e-6)
    assert m1["clip_ratio"] == pytest.approx(m2["clip_ratio"], abs=1e-6)
    # the weights are SkyRL's compute_tis_ratio
    w, _ = off_policy_correction_utils.compute_tis_ratio(old, rollout, rm, skyrl_type,
                                                         theirs_cfg.off_policy_correction)
    assert m2["creditlab/weight_mean"] == pytest.approx(float((w.expand_as(rm) * rm).sum() / rm.sum()), abs=1e-5)


def test_none_and_dual_clip_equal_skyrls_losses():
    lp, old, rollout, rm, adv = _batch(seed=3)
    for theirs, ours_section in (("regular", {}), ("dual_clip", {"dual_clip": True})):
        l1, g1, _ = _loss_and_grad(theirs, _algo(policy_loss_type=theirs), lp, old, rollout, rm, adv)
        l2, g2, _ = _loss_and_grad("creditlab_none", _algo(creditlab=ours_section), lp, old, rollout, rm, adv)
        assert torch.allclose(l1, l2.to(l1.dtype), atol=1e-6) and torch.allclose(g1, g2, atol=1e-6), theirs


def test_interq_loss_runs_with_skyrls_masks_and_refuses_its_tis():
    lp, old, rollout, rm, adv = _batch(seed=5)
    cfg = _algo(creditlab={"correction_params": {"alpha_g": 0.5}})
    cfg.off_policy_correction.sequence_mask_metric = "geometric"
    cfg.off_policy_correction.geo_mask_low, cfg.off_policy_correction.geo_mask_high = 0.9, 1.1
    loss, grad, m = _loss_and_grad("creditlab_interq", cfg, lp, old, rollout, rm, adv)
    assert torch.isfinite(loss) and grad.abs().sum() > 0
    assert "geo_sequence_mask_masked_ratio" in m and "creditlab/correction/clip_rate" in m
    assert grad[rm == 0].abs().max() == 0  # tool tokens never get a gradient
    cfg.off_policy_correction.tis_ratio_type = "token"
    with pytest.raises(ConfigError, match="tis_ratio_type"):
        _loss_and_grad("creditlab_interq", cfg, lp, old, rollout, rm, adv)
    with pytest.raises(ConfigError, match="correction_params"):
        _loss_and_grad("creditlab_interq", _algo(creditlab={"correction_params": {"nope": 1}}), lp, old, rollout,
                       rm, adv)
    with pytest.raises(ConfigError, match="rollout_logprobs"):
        PL.get("creditlab_interq")(lp, old, adv, config=_algo(), loss_mask=rm, rollout_logprobs=None)


def test_the_worker_call_with_an_omegaconf_config():
    """SkyRL's worker calls ``loss_fn(log_probs, old, adv, config=cfg.algorithm, loss_mask=, rollout_logprobs=)``;
    a DictConfig (overridden loss config) works too."""
    lp, old, rollout, rm, adv = _batch(seed=7)
    dc = OmegaConf.create({"eps_clip_low": 0.2, "eps_clip_high": 0.2, "clip_ratio_c": 3.0,
                           "off_policy_correction": {"tis_ratio_type": None, "sequence_mask_metric": None,
                                                     "outlier_token_is_threshold_low": None,
                                                     "outlier_token_is_threshold_high": None,
                                                     "token_mask_is_threshold_low": None,
                                                     "token_mask_is_threshold_high": None},
                           "creditlab": {"correction_params": {"cap": 1.5}}})
    l1, g1, _ = _loss_and_grad("creditlab_tis", dc, lp, old, rollout, rm, adv)
    l2, g2, _ = _loss_and_grad("creditlab_tis", _algo(creditlab={"correction_params": {"cap": 1.5}}), lp, old,
                               rollout, rm, adv)
    assert torch.equal(l1, l2) and torch.equal(g1, g2)


def _grpo_inputs(seed=0):
    _, _, rm = agent_batch(seed, B=8, L=16)
    g = torch.Generator().manual_seed(seed)
    rewards = torch.zeros_like(rm)
    last = (rm.shape[1] - 1 - torch.argmax(rm.flip(1), dim=1))
    rewards[torch.arange(8), last] = torch.rand(8, generator=g)
    return rewards, rm, [f"p{i // 4}" for i in range(8)]


def test_uniform_estimator_equals_skyrls_grpo_through_its_dispatch():
    rewards, rm, uids = _grpo_inputs()
    cfg = _algo()
    kw = dict(token_level_rewards=rewards, response_mask=rm, index=uids, config=cfg, values=None, gamma=1.0,
              lambd=1.0, grpo_norm_by_std=True)
    theirs, _ = ppo_utils.compute_advantages_and_returns(adv_estimator="grpo", **kw)
    ours, ret = ppo_utils.compute_advantages_and_returns(adv_estimator="creditlab_uniform", **kw)
    assert torch.allclose(theirs, ours, atol=1e-5)
    with pytest.raises(ConfigError, match="grpo_norm_by_std"):
        ppo_utils.compute_advantages_and_returns(adv_estimator="creditlab_uniform", **{**kw, "grpo_norm_by_std": False})


class _SkyRLTrainerStandIn:
    """The non-step-wise branch of SkyRL 0.3.0's ``RayPPOTrainer.compute_advantages_and_returns`` (the
    trainer module itself does not import on Python 3.11): the same call of SkyRL's dispatch."""

    def __init__(self, cfg):
        self.cfg, self.global_step = cfg, 7

    def compute_advantages_and_returns(self, data):
        a = self.cfg.trainer.algorithm
        adv, ret = ppo_utils.compute_advantages_and_returns(
            token_level_rewards=data["rewards"], response_mask=data["response_mask"], index=data.metadata["uids"],
            adv_estimator=a.advantage_estimator, config=a, values=data.get("values"), gamma=a.gamma, lambd=a.lambd,
            grpo_norm_by_std=a.grpo_norm_by_std)
        data["advantages"], data["returns"] = adv, ret
        return data


def test_trainer_mixin_gives_turns_step_and_dumps(tmp_path):
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

    from creditlab.diagnose.readers import read_dump

    old, rollout, lm = agent_batch(2, B=8, L=16)
    response = torch.zeros_like(lm)
    for i in range(8):  # every response token, observations included, up to the last turn
        response[i, : int(lm[i].nonzero().max()) + 1] = 1
    rewards = torch.zeros_like(lm)
    rewards[lm.bool() & (torch.cumsum(lm, 1) == 1)] = 0.5  # a score on each row's first token
    uids = [f"p{i // 4}" for i in range(8)]
    data = TrainingInputBatch({"response_mask": response, "loss_mask": lm, "rewards": rewards,
                               "action_log_probs": old, "rollout_logprobs": rollout, "values": None})
    data.metadata = {"uids": uids}
    cfg = cs.CreditlabSkyRLConfig.from_cli_overrides([
        "trainer.algorithm.advantage_estimator=creditlab_per_turn",
        f"trainer.algorithm.creditlab.dump_dir={tmp_path / 'dumps'}"])

    class Trainer(cs.CreditlabTrainerMixin, _SkyRLTrainerStandIn):
        pass

    out = Trainer(cfg).compute_advantages_and_returns(data)
    adv = out["advantages"]
    assert adv[lm == 0].abs().max() == 0  # observation tokens get no credit: turns come from loss_mask
    assert cs._STEP[0] == 7
    rows = cs.dump_rows(out, step=7)
    assert sum(rows[0]["policy_mask"]) == int(lm[0].sum()) and rows[0]["step"] == 7
    dump = read_dump(tmp_path / "dumps")  # what `creditlab diagnose` reads
    assert len(dump.reward) == 8 and set(dump.group_labels) == {"p0", "p1"} and dump.tokens is not None


def test_prm_decay_needs_the_step():
    rewards, rm, uids = _grpo_inputs(1)
    cfg = _algo(creditlab={"prm_schedule": "decay"})
    cs.set_global_step(None)
    with pytest.raises(ConfigError, match="global step"):
        AE.get("creditlab_prm")(token_level_rewards=rewards, response_mask=rm, index=uids, config=cfg)
    cs.set_global_step(3)
    adv, _ = AE.get("creditlab_prm")(token_level_rewards=rewards, response_mask=rm, index=uids, config=cfg)
    assert torch.isfinite(adv).all()
    with pytest.raises(ConfigError, match="unknown key"):
        AE.get("creditlab_prm")(token_level_rewards=rewards, response_mask=rm, index=uids,
                                config=_algo(creditlab={"prm_lamda": 1}))


def test_skyrls_documented_custom_algorithm_example_with_creditlab():
    """SkyRL's "Implementing Custom Algorithms" / examples/train/algorithms: register a custom advantage
    estimator (decorator) and the "reinforce" policy loss next to creditlab's, then validate a config that
    names them with SkyRL's validate_cfg and make the calls SkyRL's trainer and worker make."""
    from skyrl.train.utils.utils import validate_cfg

    @ppo_utils.register_advantage_estimator("simple_baseline")
    def compute_simple_baseline_advantage(token_level_rewards, response_mask, index, **kwargs):
        with torch.no_grad():
            response_rewards = (token_level_rewards * response_mask).sum(dim=-1, keepdim=True)
            advantages = (response_rewards - response_rewards.mean()) * response_mask
            return advantages, advantages.clone()

    def compute_reinforce_policy_loss(log_probs, old_log_probs, advantages, config, loss_mask=None,
                                      rollout_logprobs=None):
        return (-log_probs * advantages).mean(), {"clip_ratio": 0.0}

    PL.register("reinforce", compute_reinforce_policy_loss)
    try:
        for loss, est in (("reinforce", "creditlab_per_turn"), ("creditlab_interq", "simple_baseline")):
            cfg = cs.CreditlabSkyRLConfig.from_cli_overrides([
                f"trainer.algorithm.policy_loss_type={loss}", f"trainer.algorithm.advantage_estimator={est}",
                "trainer.policy.model.path=none", "trainer.logger=console"])
            validate_cfg(cfg)
            rewards, rm, uids = _grpo_inputs(2)
            a = cfg.trainer.algorithm
            adv, _ = ppo_utils.compute_advantages_and_returns(
                token_level_rewards=rewards, response_mask=rm, index=uids, adv_estimator=a.advantage_estimator,
                config=a, values=None, gamma=a.gamma, lambd=a.lambd, grpo_norm_by_std=a.grpo_norm_by_std)
            lp, old, rollout, _, _ = _batch(seed=4, B=8, L=16)
            lp = lp.detach().requires_grad_(True)
            value, metrics = PL.get(a.policy_loss_type)(lp, old, adv, config=a, loss_mask=rm,
                                                        rollout_logprobs=torch.where(rm > 0, old - 0.05, 0.0))
            value.backward()
            assert torch.isfinite(value) and "clip_ratio" in metrics
    finally:
        PL.unregister("reinforce")
        AE.unregister("simple_baseline")


def test_doc_config_block_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(doc_block("skyrl-config"), "docs/integrations.md:skyrl-config", "exec"), ns)
    a = ns["cfg"].trainer.algorithm
    assert a.policy_loss_type == "creditlab_interq" and a.advantage_estimator == "creditlab_prm"
    assert a.creditlab["correction_params"] == {"alpha_g": 0.5}


def test_fork_env_through_skyrl_gym(monkeypatch):
    import skyrl_gym

    from creditlab.rewards.fork import ForkResult

    seen = {}

    class FakeReward:
        async def score(self, items):
            seen["items"] = items
            return [ForkResult(id=it.id, reward=0.75, precision=1.0, recall=0.6) for it in items]

    monkeypatch.setattr(cs, "cached_fork_reward", lambda **judge: seen.setdefault("judge", judge) and FakeReward())
    env = skyrl_gym.make("creditlab_fork", env_config={}, extras={
        "reward_spec": {"ground_truth": [{"criterion": "mentions water", "points": 1}],
                        "judge": {"judge": "openai", "base_url": "http://x/v1", "model": "m"}}})
    env.init([{"role": "user", "content": "what helps a fever?"}])
    out = env.step("drink water")
    assert out["reward"] == 0.75 and out["done"] and out["metadata"] == {"precision": 1.0, "recall": 0.6}
    assert seen["judge"]["model"] == "m" and seen["items"][0].response == "drink water"


def test_untested_version_is_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(cs, "_skyrl_version", lambda: "9.9.9")
    monkeypatch.delenv("CREDITLAB_ALLOW_UNTESTED_SKYRL", raising=False)
    with pytest.raises(CreditlabError, match="CREDITLAB_ALLOW_UNTESTED_SKYRL=1"):
        cs.check_version()
    monkeypatch.setenv("CREDITLAB_ALLOW_UNTESTED_SKYRL", "1")
    assert cs.check_version() == "9.9.9"


def test_missing_skyrl_says_how_to_install():
    code = ("import sys; sys.modules['skyrl'] = None\n"
            "try:\n    import creditlab.integrations.skyrl\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert 'pip install "creditlab[skyrl]"' in out.stdout, out.stderr


def test_algorithm_config_is_skyrls():
    assert issubclass(cs.CreditlabAlgorithmConfig, AlgorithmConfig)
