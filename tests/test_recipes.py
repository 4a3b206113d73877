"""The recipes of ``examples/``, run as far as each trainer allows on a CPU.

* TRL (``examples/trl/grpo_creditlab.py``): end to end, the script itself (``runpy``) in its tiny
  configuration: a few GRPO steps of ``CreditlabGRPOTrainer`` with InterQ-RL on the engine log-probs of its
  ``rollout_func``, PRM credit, FORK judged by the loopback judge, the live checks, the dump, then ``creditlab
  diagnose`` on it, whose exit code the script returns.
* verl, SkyRL, OpenRLHF: their run scripts (``bash``) with ``python3``, ``ray`` and ``creditlab`` stand-ins
  first on ``PATH`` that record their arguments, so the command lines are exactly the scripts' (variables,
  quoting and the ``CORRECTION=tis`` alternative included). Then each command line goes to the trainer's
  own config loader (verl: Hydra composing the recipe's YAML on verl's ``ppo_trainer``; SkyRL: its
  ``from_cli_overrides`` and ``validate_cfg`` through the recipe's entrypoint; OpenRLHF: its own argparse
  and validation, ``openrlhf_loader.parse_command_line``), every creditlab key is checked to resolve to a
  registered component, the components run on one batch the way the trainer calls them (writing the dump
  where the recipe says), and the recorded ``creditlab diagnose`` command runs on that dump.

What needs a GPU (vLLM generation, the trainers' workers) is not run here: examples/README.md says so.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "integrations"))  # the shared builders of the integration tests
from integration_helpers import agent_batch  # noqa: E402

from creditlab.core import correction  # noqa: E402
from creditlab.diagnose import read_dump  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RUBRICS = [{"criterion": "aspirin water", "points": 2}, {"criterion": "rest", "points": 1}]


def run_script(script: Path, tmp_path: Path, **env: str) -> dict[str, list[str]]:
    """``bash script`` with ``python3``, ``ray`` and ``creditlab`` recording their arguments instead of running:
    ``{command: argv}`` (and ``"python3.env"``: the environment python3 got)."""
    stubs, record = tmp_path / "bin", tmp_path / "calls"
    stubs.mkdir(exist_ok=True)
    record.mkdir(exist_ok=True)
    for cmd in ("python3", "ray", "creditlab"):
        (stubs / cmd).write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "{record}/{cmd}"\n'
                                 f'env > "{record}/{cmd}.env"\n')
        (stubs / cmd).chmod(0o755)
    r = subprocess.run(["bash", str(script)], env={**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", **env},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = {p.name: p.read_text().split("\0")[:-1] for p in record.iterdir() if not p.name.endswith(".env")}
    calls["python3.env"] = (record / "python3.env").read_text().splitlines() if (record / "python3.env").exists() \
        else []
    return calls


def diagnose(argv: list[str]) -> tuple[int, dict]:
    """The recorded ``creditlab diagnose ...`` run for real (in this process): its exit code and diagnose.json."""
    from creditlab.cli.main import main

    assert argv[0] == "diagnose" and argv[2] == "--out", argv
    try:
        main([*argv, "--quiet"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    report = json.loads((Path(argv[3]) / "diagnose.json").read_text())
    assert (Path(argv[3]) / "report.md").is_file() and report["exit_code"] == code
    return code, report


# --------------------------------------------------------------------------------------------
# TRL: the script, end to end


def test_trl_recipe_trains_dumps_and_diagnoses(tmp_path, monkeypatch, capsys):
    script = EXAMPLES / "trl" / "grpo_creditlab.py"
    out = tmp_path / "trl"
    monkeypatch.setattr(sys, "argv", [str(script), "--tiny", "--steps", "2", "--device", "cpu",
                                      "--output-dir", str(out)])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    report = json.loads((out / "diagnose" / "diagnose.json").read_text())
    assert exit_.value.code == report["exit_code"] in (0, 1)  # the script returns diagnose's exit code
    assert "creditlab diagnose: exit code" in capsys.readouterr().out
    logs = [h for h in json.loads((out / "train_log.json").read_text()) if "loss" in h]
    assert len(logs) == 2 and all(np.isfinite(h["loss"]) for h in logs)
    assert all(h["creditlab/mismatch/k3"] > 0 for h in logs)  # the FP8 engine differs from the learner
    assert all("creditlab/correction/alpha_q50" in h for h in logs)  # InterQ-RL ran on the engine log-probs
    assert all("rewards/fork/mean" in h and "reward/fork/precision" in h for h in logs)  # FORK was the reward
    dump = read_dump(out / "dump")
    assert sorted(set(dump.step.tolist())) == [0, 1] and len(dump.reward) == 16  # a batch per step, as generated
    assert {c["id"] for c in report["checks"]} >= {"mismatch.k3", "baseline.degenerate_groups"}
    k3 = next(c for c in report["checks"] if c["id"] == "mismatch.k3")
    assert k3["status"] != "skip" and k3["value"] > 0  # the dump holds both log-probs


def test_trl_recipe_refuses_a_real_run_without_its_model_and_judge(capsys):
    ns = runpy.run_path(str(EXAMPLES / "trl" / "grpo_creditlab.py"), run_name="trl_recipe")
    with pytest.raises(SystemExit):
        ns["parse_args"](["--output-dir", "x", "--model", "m"])
    assert "a real run needs --model, --dataset and --judge-url" in capsys.readouterr().err
    assert set(ns["CORRECTIONS"]) == {"interq", "tis"} and set(ns["CORRECTIONS"]) <= set(correction.CORRECTIONS)
    for arm, params in ns["CORRECTIONS"].items():
        assert set(params) <= set(correction.correction_params(arm))


# --------------------------------------------------------------------------------------------
# verl: the run script, composed on verl's config


def _verl_config(calls):
    from hydra import compose, initialize_config_dir

    argv = calls["python3"]
    assert argv[:2] == ["-m", "verl.trainer.main_ppo"], argv
    opts = dict(a[2:].split("=", 1) for a in argv[2:] if a.startswith("--"))
    with initialize_config_dir(config_dir=opts["config-path"], version_base=None):
        return compose(config_name=opts["config-name"], overrides=[a for a in argv[2:] if not a.startswith("--")])


@pytest.mark.parametrize("arm", ["interq", "tis"])
def test_verl_recipe_composes_and_its_components_run(arm, tmp_path):
    pytest.importorskip("verl", reason='verl is not installed (pip install "creditlab[verl]")')
    from verl import DataProto
    from verl.trainer.ppo import core_algos, ray_trainer, rollout_corr_helper
    from verl.utils.skip.skip_manager import SkipManager

    import creditlab.integrations.verl as cv  # what VERL_USE_EXTERNAL_MODULES loads in every verl process

    out = tmp_path / "out"
    calls = run_script(EXAMPLES / "verl" / "run_creditlab_grpo.sh", tmp_path, OUT=str(out), CORRECTION=arm)
    assert "VERL_USE_EXTERNAL_MODULES=creditlab.integrations.verl" in calls["python3.env"]
    cfg = _verl_config(calls)
    algo = cfg.algorithm
    # every creditlab key resolves to a registered component
    assert cv.parse_rollout_is(algo.rollout_correction.rollout_is)[0] == arm
    assert algo.adv_estimator == "creditlab_prm" and algo.adv_estimator in core_algos.ADV_ESTIMATOR_REGISTRY
    assert cv._settings(algo).prm_schedule == "decay"  # the knobs are CreditSettings fields
    assert algo.creditlab.dump_dir == str(out / "dump")
    assert core_algos.get_policy_loss_fn(cfg.actor_rollout_ref.actor.policy_loss.loss_mode) is \
        cv.compute_policy_loss_creditlab
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    rf = cfg.reward.custom_reward_function
    assert rf.path == "pkg://creditlab.integrations.verl" and getattr(cv, rf.name) is cv.fork_reward
    assert calls["creditlab"] == ["diagnose", str(out / "dump"), "--out", str(out / "diagnose")]
    if arm == "tis":
        return  # the rest is the same pipeline

    # the components on one batch, as verl calls them (decoupled mode: on the driver, once per step)
    B, L = 8, 24
    old, rollout, rm = agent_batch(5, B=B, L=L, mismatch=0.3)
    outcome = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.5])
    rewards = cv.pack_turn_rewards(rm, outcome)  # FORK's one score per response: no process score
    data = DataProto.from_dict(
        tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": rm,
                 "token_level_scores": rewards, "token_level_rewards": rewards},
        non_tensors={"uid": np.array([f"p{i // 4}" for i in range(B)], dtype=object)}, meta_info={"global_steps": 1})
    data, metrics = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(data, algo.rollout_correction)
    assert metrics["rollout_corr/creditlab/mismatch/k3"] > 0
    assert "rollout_corr/creditlab/correction/alpha_q50" in metrics
    SkipManager.set_step(1)
    # as verl's trainer calls it (the module global, which creditlab wraps): dumps to the recipe's dump_dir
    data = ray_trainer.compute_advantage(data, adv_estimator=algo.adv_estimator, config=algo)
    lp = (old + 0.05 * torch.randn(old.shape)).clamp(max=0).requires_grad_(True)
    loss, _ = cv.compute_policy_loss_creditlab(old, lp, data.batch["advantages"], rm,
                                               config=cfg.actor_rollout_ref.actor,
                                               rollout_is_weights=data.batch["rollout_is_weights"])
    loss.backward()
    assert torch.isfinite(loss) and lp.grad is not None
    live = cv.live_metrics(data)
    assert live["rollout_corr/creditlab/mismatch/k3"] > 0
    with _judge() as url:  # the recipe's reward_kwargs, pointed at the loopback judge
        kwargs = {**rf.reward_kwargs, "base_url": url, "max_retries": 0}
        score = asyncio.run(cv.fork_reward("rubrics", "take aspirin with water . rest .", RUBRICS,
                                           {"prompt": "How do I treat a headache?", "index": 0}, **kwargs))
    assert score["score"] > 0
    code, report = diagnose(calls["creditlab"])
    assert len(read_dump(out / "dump").reward) == B
    assert next(c for c in report["checks"] if c["id"] == "mismatch.k3")["value"] > 0


def _judge():
    from creditlab.judge.testing import ChatServer

    class Url:
        def __enter__(self):
            self.srv = ChatServer().__enter__()
            return self.srv.url

        def __exit__(self, *exc):
            return self.srv.__exit__(*exc)

    return Url()


# --------------------------------------------------------------------------------------------
# SkyRL: the run script, through the recipe's entrypoint and SkyRL's config


@pytest.mark.parametrize("arm", ["interq", "tis"])
def test_skyrl_recipe_validates_and_its_components_run(arm, tmp_path):
    pytest.importorskip("skyrl", reason='SkyRL is not installed (pip install "creditlab[skyrl]")')
    from skyrl_ray_worker import load_backends_without_init

    load_backends_without_init()  # Python < 3.12: skyrl.backends without its package __init__
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.utils import ppo_utils
    from skyrl_gym.envs import registration

    import creditlab.integrations.skyrl as cs

    out = tmp_path / "out"
    calls = run_script(EXAMPLES / "skyrl" / "run_creditlab.sh", tmp_path, OUT=str(out), CORRECTION=arm)
    argv = calls["python3"]
    assert Path(argv[0]) == EXAMPLES / "skyrl" / "main_creditlab.py"
    recipe = runpy.run_path(argv[0], run_name="skyrl_recipe")  # the entrypoint's module code
    cfg = recipe["config"](argv[1:])  # CreditlabSkyRLConfig.from_cli_overrides + SkyRL's validate_cfg
    a = cfg.trainer.algorithm
    assert a.policy_loss_type == f"creditlab_{arm}"
    assert a.policy_loss_type in ppo_utils.PolicyLossRegistry.list_available()
    assert a.advantage_estimator == "creditlab_prm" and a.advantage_estimator in \
        ppo_utils.AdvantageEstimatorRegistry.list_available()
    assert set(a.creditlab["correction_params"]) <= set(correction.correction_params(arm))
    assert cs._settings(a).prm_schedule == "decay"
    assert cfg.environment.env_class == "creditlab_fork" in registration.registry
    assert cfg.generator.sampling_params.logprobs == 1
    assert a.creditlab["dump_dir"] == str(out / "dump")
    assert calls["creditlab"] == ["diagnose", str(out / "dump"), "--out", str(out / "diagnose")]
    if sys.version_info >= (3, 12):  # SkyRL's trainer module imports there only
        from skyrl.train.trainer import RayPPOTrainer

        assert issubclass(recipe["trainer_class"](), cs.CreditlabTrainerMixin) and \
            issubclass(recipe["trainer_class"](), RayPPOTrainer)

    # the components on one batch, as SkyRL's trainer and worker call them (with the mixin's turns and step)
    B, L = 8, 20
    old, rollout, lm = agent_batch(6, B=B, L=L, mismatch=0.3)
    response = (torch.cumsum(lm.flip(1), 1).flip(1) > 0).float()  # every response token up to the last turn
    rewards = torch.zeros(B, L)
    rewards[torch.arange(B), L - 1 - torch.argmax(lm.flip(1), dim=1)] = torch.tensor([1.0, 0, 0.5, 0, 1, 1, 0, 1])
    uids = [f"p{i // 4}" for i in range(B)]
    cs.set_global_step(3)
    token = cs._POLICY_MASK.set(lm)
    try:
        adv, _ = ppo_utils.compute_advantages_and_returns(
            token_level_rewards=rewards, response_mask=response, index=uids, adv_estimator=a.advantage_estimator,
            config=a, values=None, gamma=a.gamma, lambd=a.lambd, grpo_norm_by_std=a.grpo_norm_by_std)
    finally:
        cs._POLICY_MASK.reset(token)
    assert adv[lm == 0].abs().max() == 0
    lp = (old + 0.05 * torch.randn(old.shape)).clamp(max=0).requires_grad_(True)
    loss, metrics = ppo_utils.PolicyLossRegistry.get(a.policy_loss_type)(lp, old, adv, config=a, loss_mask=lm,
                                                                         rollout_logprobs=rollout)
    loss.backward()
    assert torch.isfinite(loss) and metrics["creditlab/mismatch/k3"] > 0
    batch = TrainingInputBatch({"response_mask": response, "loss_mask": lm, "rewards": rewards,
                                "action_log_probs": old, "rollout_logprobs": rollout})
    batch.metadata = {"uids": uids}
    cs.dump_batch(batch, a.creditlab["dump_dir"], step=3)  # what CreditlabTrainerMixin writes each step
    assert cs.live_metrics(batch)["creditlab/mismatch/k3"] > 0
    if arm == "interq":
        code, report = diagnose(calls["creditlab"])
        assert len(read_dump(out / "dump").reward) == B


# --------------------------------------------------------------------------------------------
# OpenRLHF: the run script, through OpenRLHF's own command line and modules


def _driver_env_vars() -> set[str]:
    """The env_vars OpenRLHF's driver passes to ray.init (read from its train_ppo_ray.py)."""
    from openrlhf_loader import openrlhf_root

    src = (openrlhf_root() / "openrlhf" / "cli" / "train_ppo_ray.py").read_text()
    block = re.search(r'"env_vars":\s*\{(.*?)\}', src, re.S)
    return set(re.findall(r'"([A-Z_]+)":', block.group(1)))


@pytest.mark.parametrize("arm", ["interq", "tis"])
def test_openrlhf_recipe_parses_and_its_components_run(arm, tmp_path, monkeypatch):
    from openrlhf_loader import load_openrlhf, parse_command_line
    from ray.runtime_env.runtime_env import _merge_runtime_env

    mods = load_openrlhf()  # OpenRLHF 0.11.2's own modules (skips where the package registry is unreachable)
    import creditlab.integrations.openrlhf as co

    out = tmp_path / "out"
    calls = run_script(EXAMPLES / "openrlhf" / "run_creditlab_grpo.sh", tmp_path, OUT=str(out), CORRECTION=arm)
    argv = calls["ray"]
    assert argv[:2] == ["job", "submit"]
    runtime_env = json.loads(next(x for x in argv if x.startswith("--runtime-env-json="))[len("--runtime-env-json="):])
    hook = runtime_env["worker_process_setup_hook"]
    assert hook == "creditlab.integrations.openrlhf.install" and co.install is getattr(co, hook.rsplit(".", 1)[1])
    env = runtime_env["env_vars"]
    assert co.parse_correction(env[co.CORRECTION_ENV])[0] == arm
    assert env[co.DUMP_ENV] == str(out / "dump")
    # Ray merges the job's runtime env with the one OpenRLHF's driver gives ray.init (a conflict is an error)
    driver = {"env_vars": {k: "x" for k in _driver_env_vars()}}
    assert driver["env_vars"] and _merge_runtime_env(runtime_env, driver) is not None
    assert calls["creditlab"] == ["diagnose", str(out / "dump"), "--out", str(out / "diagnose")]
    i = argv.index("--")
    assert argv[i + 1:i + 4] == ["python3", "-m", "openrlhf.cli.train_ppo_ray"]
    args = parse_command_line(argv[i + 4:])  # OpenRLHF's own parser and validation
    adv = args["algo"]["advantage"]
    assert adv["is_correction_level"] == "token" and args["actor"]["policy_loss_type"] == "ppo"
    (reward_file,) = args["reward"]["remote_url"]
    assert Path(reward_file) == EXAMPLES / "openrlhf" / "fork_reward_func.py" and args["data"]["label_key"] == "rubrics"
    if arm == "tis":
        return

    # the components on one batch: the loss as OpenRLHF's actor builds it from these arguments, the
    # experience maker, the reward_func file loaded by OpenRLHF's executor
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    co.install()
    actor = args["actor"]
    loss_fn = mods["loss"].PolicyLoss(
        clip_eps_low=actor["eps_clip_low_high"][0], clip_eps_high=actor["eps_clip_low_high"][1],
        dual_clip=actor["dual_clip"], token_level_loss=actor["loss_agg_mode"] == "token-mean",
        policy_loss_type=actor["policy_loss_type"], is_correction_level=adv["is_correction_level"],
        is_correction_mode=adv["is_correction_mode"], is_correction_gating=adv["is_correction_gating"],
        is_correction_threshold=adv["is_correction_threshold"])
    n, B, L = args["rollout"]["n_samples_per_prompt"], 16, 20
    old, rollout, lm = agent_batch(7, B=B, L=L, mismatch=0.3)
    z = torch.zeros(B, 2)
    mask, old, rollout = torch.cat([z, lm], 1).bool(), torch.cat([z, old * lm], 1), torch.cat([z, rollout], 1)
    lp = (old + 0.05 * torch.randn(old.shape) * mask).clamp(max=0).requires_grad_(True)
    out_loss = loss_fn(lp, old, torch.randn(B, 1).expand_as(old) * mask, action_mask=mask, rollout_log_probs=rollout)
    out_loss[0].backward()
    assert torch.isfinite(out_loss[0]) and loss_fn.creditlab_metrics["creditlab/mismatch/k3"] > 0
    from types import SimpleNamespace

    rewards = torch.tensor([1.0, 0, 0.5, 0, 1, 1, 0, 1] * 2)
    exp = mods["experience"].Experience(
        sequences=torch.randint(5, 20, (B, L + 3)), attention_mask=torch.ones(B, L + 3, dtype=torch.long),
        action_mask=mask, action_log_probs=old, rollout_log_probs=rollout, rewards=rewards.clone(),
        kl=torch.zeros(mask.shape), index=list(range(B)), info={"reward": rewards.clone()})
    maker = mods["experience_maker"].RemoteExperienceMaker.__new__(mods["experience_maker"].RemoteExperienceMaker)
    maker.advantage_estimator, maker.kl_ctl = adv["estimator"], SimpleNamespace(value=0.0)
    maker.strategy = SimpleNamespace(args=SimpleNamespace(
        rollout=SimpleNamespace(n_samples_per_prompt=n), reward=SimpleNamespace(clip_range=None),
        algo=SimpleNamespace(advantage=SimpleNamespace(**{k: adv[k] for k in ("estimator", "gamma", "lambd",
                                                                              "no_std_norm")}))))
    (done,) = maker.compute_advantages_and_returns([exp])  # OpenRLHF's method, patched: dump + live checks
    assert float(done.info["creditlab/mismatch/k3"][0]) > 0
    with _judge() as url:
        monkeypatch.setenv("JUDGE_URL", url)
        executor = mods["agent"].SingleTurnAgentExecutor(remote_rm_url=reward_file)  # loads the file, its way
        scored = executor.reward_func(["How do I treat a headache? take aspirin with water . rest ."],
                                      ["How do I treat a headache?"], [RUBRICS])
    assert float(scored["rewards"][0]) > 0
    code, report = diagnose(calls["creditlab"])
    assert len(read_dump(out / "dump").reward) == B
    assert next(c for c in report["checks"] if c["id"] == "mismatch.k3")["value"] > 0


def test_every_recipe_is_in_the_examples_readme():
    readme = (EXAMPLES / "README.md").read_text()
    for path in ("verl/run_creditlab_grpo.sh", "verl/config/creditlab_grpo.yaml", "skyrl/run_creditlab.sh",
                 "skyrl/main_creditlab.py", "trl/grpo_creditlab.py", "openrlhf/run_creditlab_grpo.sh",
                 "openrlhf/fork_reward_func.py"):
        assert (EXAMPLES / path).is_file() and path in readme, path
