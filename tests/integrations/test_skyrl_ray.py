"""creditlab inside SkyRL's own Ray startup and registry sync (SkyRL 0.3.0 here, 0.4.0 in
scripts/check_skyrl_py312.sh): SkyRL's ``initialize_ray(cfg)`` starts a local Ray and hands every
registered function to its registry actors; Ray workers that have never imported creditlab look every
creditlab loss and estimator up by name and call it. The other tests do what SkyRL's own registry
tests (tests/backends/skyrl_train/utils/test_ppo_utils.py) do, with creditlab loaded: register, sync,
look up and call across Ray processes, unregister, errors, a Ray restart.

The workers run tests/integrations/skyrl_ray_worker.py (this folder is put on their ``PYTHONPATH``);
see its docstring for how SkyRL 0.3.0's registries are loaded on Python 3.11."""

from __future__ import annotations

import os
import pickle
import sys

import pytest
import torch

pytest.importorskip("skyrl", reason='SkyRL is not installed (pip install "creditlab[skyrl]")')
ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "creditlab[skyrl]")')

import skyrl_ray_worker as worker  # noqa: E402  (first: loads skyrl.backends on Python 3.11)
from skyrl.backends.skyrl_train.utils import ppo_utils  # noqa: E402

import creditlab.integrations.skyrl as cs  # noqa: E402
from creditlab.core import correction  # noqa: E402
from creditlab.errors import ConfigError  # noqa: E402

PL, AE = ppo_utils.PolicyLossRegistry, ppo_utils.AdvantageEstimatorRegistry
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module", autouse=True)
def skyrl_ray(tmp_path_factory):
    """A local Ray started by SkyRL's own ``initialize_ray(cfg)`` (ray.init, then sync_registries),
    as a training driver starts it after importing creditlab.integrations.skyrl."""
    from skyrl.train.utils.utils import initialize_ray

    if ray.is_initialized():
        ray.shutdown()
    saved = dict(os.environ)  # initialize_ray sets RAY_BACKEND_LOG_LEVEL and SKYRL_LOG_FILE
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
    cfg = cs.CreditlabSkyRLConfig.from_cli_overrides([f"trainer.log_path={tmp_path_factory.mktemp('skyrl-logs')}"])
    try:
        initialize_ray(cfg)
        yield
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)
        for registry in (PL, AE):  # their actor handles belong to the Ray that is gone
            registry._ray_actor, registry._synced_to_actor = None, False
        cs.set_global_step(None)


def _assert_same_calls(got: dict, want: dict) -> None:
    assert set(got["losses"]) == set(want["losses"]) and set(got["estimators"]) == set(want["estimators"])
    for name, w in want["losses"].items():
        g = got["losses"][name]
        assert g["type"] == "creditlab.integrations.skyrl.SkyRLFunction", (name, g["type"])
        assert torch.equal(g["loss"], w["loss"]) and torch.equal(g["grad"], w["grad"]), name
        assert g["metrics"] == w["metrics"], name
        assert torch.isfinite(g["loss"]) and g["grad"].abs().sum() > 0, name
    for name, w in want["estimators"].items():
        g = got["estimators"][name]
        assert g["type"] == "creditlab.integrations.skyrl.SkyRLFunction", (name, g["type"])
        assert torch.equal(g["advantages"], w["advantages"]) and torch.equal(g["returns"], w["returns"]), name


def test_initialize_ray_hands_every_creditlab_function_to_skyrls_actors():
    """SkyRL's registries pickle their functions with cloudpickle (the extra installs it: without it
    SkyRL falls back to plain pickle); creditlab's travel by reference, a few dozen bytes that load to
    the driver's own objects, and plain pickle takes them too (nothing is pickled by value)."""
    import cloudpickle

    assert ppo_utils.cloudpickle is cloudpickle
    for registry, names in ((PL, cs.POLICY_LOSSES), (AE, cs.ESTIMATORS)):
        actor = ray.get_actor(registry._actor_name)
        assert set(names) <= set(ray.get(actor.list_available.remote())), registry._actor_name
        for name in names:
            blob = ray.get(actor.get.remote(name))
            assert len(blob) < 200 and b"creditlab.integrations.skyrl" in blob and b"_lookup" in blob, blob
            fn = registry._functions[name]
            assert cloudpickle.loads(blob) is fn and pickle.loads(pickle.dumps(fn)) is fn
            assert isinstance(fn, cs.SkyRLFunction) and fn.__name__ == name


def test_a_fresh_worker_looks_up_and_calls_every_creditlab_function():
    """A Ray worker that has not imported creditlab gets every loss and estimator from SkyRL's registry
    actor (loading one imports creditlab there) and computes exactly what the driver computes."""
    names = list(cs.POLICY_LOSSES), list(cs.ESTIMATORS)
    task = ray.remote(max_calls=1)(worker.call_registered)  # a worker of its own, not reused
    got = ray.get(task.remote(*names), timeout=120)
    assert got["pid"] != os.getpid()
    assert got["imported_before"] == {"creditlab.integrations.skyrl": False}
    assert got["imported_after"] == {"creditlab.integrations.skyrl": True}
    _assert_same_calls(got, worker.call_registered(*names))


def test_an_arm_registered_by_a_user_module_reaches_the_workers():
    """An arm registered at import of a user module, then install(): a worker that loads its loss
    imports that module (the entry carries its name) and runs the arm."""
    import skyrl_ray_user_arm as user

    name = cs.PREFIX + user.ARM
    try:
        cs.install()  # Ray is up: registers creditlab_ray_half_tis and syncs it to SkyRL's actor
        assert PL._functions[name].origin == "skyrl_ray_user_arm"
        config = {**worker.CONFIG, "creditlab": {"correction_params": {"cap": 1.2}}}
        got = ray.get(ray.remote(worker.call_registered).remote([name, "creditlab_tis"], [], 1, config,
                                                                ("skyrl_ray_user_arm",)), timeout=120)
        assert got["imported_before"]["skyrl_ray_user_arm"] is False
        assert got["imported_after"]["skyrl_ray_user_arm"] is True
        _assert_same_calls(got, worker.call_registered([name, "creditlab_tis"], [], 1, config))
        # and it is the user's arm: halfway between token TIS (cap 1.2) and no correction
        base = worker.call_registered(["creditlab_none"], [], 1)["losses"]["creditlab_none"]["loss"]
        tis = got["losses"]["creditlab_tis"]["loss"]
        assert torch.allclose(got["losses"][name]["loss"], (base + tis) / 2, atol=1e-6)
        assert not torch.allclose(tis, base, atol=1e-3)
    finally:
        correction.unregister_correction(user.ARM)
        PL.unregister(name)
        cs._LOSS_FNS.pop(name, None)


def test_an_entry_whose_arm_is_missing_loads_and_fails_at_the_call():
    """An arm a worker cannot get (registered in the driver script, or its module fails to import):
    loading it never raises (SkyRL loads every name of its actor at each lookup, so one failure would
    fail them all); calling it is a ConfigError that says why."""
    ghost = cs.SkyRLFunction(cs.POLICY_LOSS, "ghost_arm", origin="no_such_module_for_creditlab")
    PL.register("creditlab_ghost_arm", ghost)  # Ray is up: sent to SkyRL's actor
    try:
        x = worker.inputs()
        loaded = pickle.loads(pickle.dumps(ghost))  # in this process: the arm is not registered here either
        with pytest.raises(ConfigError, match="'ghost_arm' is not registered in this process.*"
                                              "No module named 'no_such_module_for_creditlab'"):
            loaded(x["log_probs"], x["old_log_probs"], x["advantages"], config=worker.CONFIG,
                   loss_mask=x["loss_mask"], rollout_logprobs=x["rollout_logprobs"])
        # a worker still looks the others up, and gets the ConfigError only from this one
        ok = ray.get(ray.remote(worker.call_registered).remote(["creditlab_interq"], ["creditlab_prm"]), timeout=120)
        assert set(ok["losses"]) == {"creditlab_interq"}
        # which reaches the driver as itself (ConfigError pickles with its field and message)
        with pytest.raises(ConfigError, match="'creditlab_ghost_arm': correction 'ghost_arm' is not registered") as err:
            ray.get(ray.remote(worker.call_registered).remote(["creditlab_ghost_arm"], []), timeout=120)
        assert isinstance(err.value, ray.exceptions.RayTaskError)
        assert err.value.parameter == "trainer.algorithm.policy_loss_type"
    finally:
        PL.unregister("creditlab_ghost_arm")
        cs._LOSS_FNS.pop("creditlab_ghost_arm", None)


# --------------------------------------------------------------------------------------------
# SkyRL's own registry tests, with creditlab loaded and Ray up


def _dummy_estimator(scale: float):
    def estimator(**kwargs):
        rewards = kwargs["token_level_rewards"]
        return rewards * scale, rewards * (scale + 1)

    return estimator


def test_register_retrieve_list_unregister_next_to_creditlab():
    """SkyRL's registration_and_retrieval, unregister and named_actor_creation tests."""
    import cloudpickle

    fn = _dummy_estimator(2.0)
    AE.register("test_basic", fn)
    try:
        assert AE.get("test_basic") is fn
        available = AE.list_available()
        assert "test_basic" in available and set(cs.ESTIMATORS) <= set(available)
        actor = ray.get_actor("advantage_estimator_registry")
        assert {"test_basic", *cs.ESTIMATORS} <= set(ray.get(actor.list_available.remote()))
        rewards = torch.tensor([[1.0, 2.0]])
        adv, ret = cloudpickle.loads(ray.get(actor.get.remote("test_basic")))(token_level_rewards=rewards)
        assert torch.equal(adv, rewards * 2) and torch.equal(ret, rewards * 3)
    finally:
        AE.unregister("test_basic")
    assert "test_basic" not in AE.list_available()
    assert "test_basic" not in ray.get(ray.get_actor("advantage_estimator_registry").list_available.remote())
    assert set(cs.ESTIMATORS) <= set(AE.list_available()) and set(cs.POLICY_LOSSES) <= set(PL.list_available())


def test_decorators_and_dispatch_next_to_creditlab():
    """SkyRL's advantage_estimator_registry_specific and policy_loss_registry_specific tests: its
    decorators register, its dispatch runs both theirs and creditlab's estimators."""
    import numpy as np
    from skyrl.train.config import AlgorithmConfig

    @ppo_utils.register_advantage_estimator("test_decorator")
    def decorated_estimator(**kwargs):
        return torch.ones_like(kwargs["token_level_rewards"]), torch.ones_like(kwargs["token_level_rewards"])

    @ppo_utils.register_policy_loss("test_policy_decorator")
    def decorated_policy_loss(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_log_probs=None):
        return torch.tensor(1.5), {"clip_ratio": 0.3}

    try:
        assert AE.get("test_decorator") is decorated_estimator
        assert PL.get("test_policy_decorator") is decorated_policy_loss
        rewards, mask = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), torch.ones(2, 3)
        kw = dict(token_level_rewards=rewards, response_mask=mask, index=np.array(["0", "0"]), config={})
        adv, _ = ppo_utils.compute_advantages_and_returns(adv_estimator="test_decorator", **kw)
        assert torch.equal(adv, torch.ones_like(rewards))
        theirs, _ = ppo_utils.compute_advantages_and_returns(adv_estimator="grpo", **kw)
        ours, _ = ppo_utils.compute_advantages_and_returns(adv_estimator="creditlab_uniform", **kw)
        assert torch.allclose(theirs, ours, atol=1e-5) and ours.abs().sum() > 0
        loss, metrics = PL.get("test_policy_decorator")(log_probs=torch.tensor([[0.1]]),
                                                        old_log_probs=torch.tensor([[0.2]]),
                                                        advantages=torch.tensor([[1.0]]),
                                                        config=AlgorithmConfig(policy_loss_type="test_policy_decorator"))
        assert loss.item() == 1.5 and metrics["clip_ratio"] == 0.3
    finally:
        AE.unregister("test_decorator")
        PL.unregister("test_policy_decorator")


def test_error_handling_next_to_creditlab():
    """SkyRL's error_handling test: unknown names, unregistering an unknown name, a name taken twice
    (creditlab's included); the lists in the errors name creditlab's functions."""
    with pytest.raises(ValueError, match="Unknown advantage estimator 'non_existent'.*creditlab_uniform"):
        AE.get("non_existent")
    with pytest.raises(ValueError, match="Unknown policy loss 'non_existent_policy'.*creditlab_interq"):
        PL.get("non_existent_policy")
    with pytest.raises(ValueError, match="not registered"):
        AE.unregister("non_existent")
    fn = _dummy_estimator(1.0)
    AE.register("test_dup", fn)
    try:
        with pytest.raises(ValueError, match="already registered"):
            AE.register("test_dup", fn)
    finally:
        AE.unregister("test_dup")
    with pytest.raises(ValueError, match="already registered"):
        PL.register("creditlab_interq", fn)
    assert isinstance(PL.get("creditlab_interq"), cs.SkyRLFunction)


def test_cross_ray_process_next_to_creditlab():
    """SkyRL's test_registry_cross_ray_process: functions registered after Ray started, looked up and
    called in a Ray worker (next to creditlab's, which that worker also calls), and a registration
    after that."""

    def test_policy_loss(log_probs, old_log_probs, advantages, config, loss_mask=None):
        return torch.tensor(2.0), {"clip_ratio": 0.5}

    def test_policy_loss_2(log_probs, old_log_probs, advantages, config, loss_mask=None):
        return torch.tensor(3.0), {"clip_ratio": 0.6}

    PL.register("cross_process_test", test_policy_loss)
    AE.register("cross_process_adv_test", _dummy_estimator(2.0))
    try:
        loss, metrics, adv, ret = ray.get(ray.remote(worker.skyrl_registry_access).remote(
            "cross_process_test", "cross_process_adv_test"), timeout=120)
        assert loss.item() == 2.0 and metrics["clip_ratio"] == 0.5
        assert torch.equal(adv, torch.tensor([[2.0, 4.0]])) and torch.equal(ret, torch.tensor([[3.0, 6.0]]))
        got = ray.get(ray.remote(worker.call_registered).remote(["creditlab_interq"], ["creditlab_per_turn"]),
                      timeout=120)
        _assert_same_calls(got, worker.call_registered(["creditlab_interq"], ["creditlab_per_turn"]))
        PL.register("cross_process_test_2", test_policy_loss_2)
        from skyrl.train.config import AlgorithmConfig

        loss_2, metrics_2 = PL.get("cross_process_test_2")(
            log_probs=torch.tensor([[0.1]]), old_log_probs=torch.tensor([[0.2]]), advantages=torch.tensor([[1.0]]),
            config=AlgorithmConfig(policy_loss_type="cross_process_test_2"))
        assert loss_2.item() == 3.0 and metrics_2["clip_ratio"] == 0.6
    finally:
        for registry, name in ((PL, "cross_process_test"), (PL, "cross_process_test_2"),
                               (AE, "cross_process_adv_test")):
            if name in registry._functions:
                registry.unregister(name)


def test_registries_after_a_ray_restart():
    """SkyRL's test_registry_reset_after_ray_shutdown: Ray stops and starts again (a plain ray.init)
    and the advantage registry is reset, which also drops creditlab's estimators; install() puts them
    back and syncs them, and a fresh worker of the new Ray gets and calls every creditlab function.
    (Last in this module: it leaves the second Ray running for the fixture to stop.)"""
    ray.shutdown()
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        AE.reset()
        assert not set(cs.ESTIMATORS) & set(AE._functions)
        fn = _dummy_estimator(2.0)
        AE.register("named_actor_test", fn)
        assert AE.get("named_actor_test") is fn and ray.get_actor("advantage_estimator_registry") is not None
        cs.install()
    finally:  # SkyRL's own test module repopulates its registries when it ends
        if "named_actor_test" in AE._functions:
            AE.unregister("named_actor_test")
        ppo_utils.repopulate_all_registries()
        cs.install()
    assert set(cs.ESTIMATORS) <= set(ray.get(ray.get_actor("advantage_estimator_registry").list_available.remote()))
    names = list(cs.POLICY_LOSSES), list(cs.ESTIMATORS)
    got = ray.get(ray.remote(worker.call_registered).remote(*names), timeout=120)
    assert got["imported_before"] == {"creditlab.integrations.skyrl": False}
    _assert_same_calls(got, worker.call_registered(*names))
    assert sys.modules["creditlab.integrations.skyrl"] is cs
