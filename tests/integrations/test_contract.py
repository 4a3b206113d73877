"""The integration contract (``creditlab.integrations.CONTRACT``) on every integration of
``creditlab.integrations.INTEGRATIONS``, each against its real trainer.

Two kinds of checks:

* from the source alone (no trainer imported), for every module of the table: it defines every duty
  under the contract's name and exports it, the table lists every integration module, the old names
  of :data:`~creditlab.integrations.RENAMED` are aliases only, and the trainer is wired in where
  docs/contributing.md ("Adding a trainer") says (pyproject extra, CLI, README, docs). A trainer added to
  the table without a duty fails here, installed or not;
* with the trainer, one test per duty and integration: ``check_version`` / ``TESTED_VERSIONS``,
  ``install`` (idempotent, registers what it returns, refuses an untested version), ``dump_rows`` on the
  trainer's own batch object (read back by ``creditlab diagnose``'s reader), ``fork_reward`` in the
  trainer's reward shape with the loopback judge, ``live_metrics`` (namespaced floats, equal to
  ``creditlab diagnose``'s checks on the dumped rows), and the deprecated aliases. The batches are built
  as the other integration tests build them: a verl ``DataProto`` of ``agent_batch``, the output of
  ``CreditlabGRPOTrainer._generate_and_score_completions`` on the tiny model, a SkyRL
  ``TrainingInputBatch``, an OpenRLHF ``Experience``. A new trainer needs a builder in :data:`CASES` (a
  test says so).

SkyRL on Python < 3.12 (the suite's 3.11, SkyRL 0.3.0): ``skyrl.backends`` is loaded without its package
``__init__``, as in tests/integrations/test_skyrl.py; SkyRL missing: its cases skip with the reason.
OpenRLHF 0.11.2 does not install beside the other trainers (:data:`OUTSIDE_DEV`): its modules are installed
from the package registry without their dependencies and loaded by path (``openrlhf_loader.py``); a registry
that cannot be reached skips its cases with the reason.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.metadata
import inspect
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from integration_helpers import agent_batch, assert_engine_differs, make_rollout_func, tiny_model, tiny_tokenizer
from packaging.version import Version

import creditlab.integrations as ci
from creditlab.core import correction, credit
from creditlab.diagnose import read_dump, run_checks, write_dump
from creditlab.errors import ConfigError, CreditlabError
from creditlab.integrations import CONTRACT, INTEGRATIONS
from creditlab.integrations._live import FIRST_TURN, LIVE_CHECKS, PREFIX, TRAJECTORY_ESS, metric_name

SRC = Path(ci.__file__).resolve().parent
#: The names each integration gave its duties before the contract (removed, CHANGELOG 0.2.0).
OLD_NAMES = {"verl": ("TESTED_VERL_VERSIONS", "rows_from_dataproto", "fork_compute_score"),
             "trl": ("TESTED_TRL_VERSIONS", "check_trl_version", "fork_reward_func"),
             "skyrl": ("TESTED_SKYRL_VERSIONS", "rows_from_training_batch", "fork_score"),
             "openrlhf": ()}
#: Trainers the dev extra cannot install beside the others, and why; their tests install them themselves.
OUTSIDE_DEV = {"openrlhf": "openrlhf 0.11.2 pins transformers==5.15.0 (skyrl 0.3.0 pins <=5.8.0), deepspeed and "
                           "flash-attn (no CPU install): its tests install it with pip --no-deps (openrlhf_loader.py)"}
RUBRICS = [{"criterion": "aspirin water", "points": 2}, {"criterion": "rest", "points": 1}]
PROMPT = "How do I treat a headache?"
# loopback judge (creditlab.judge.testing): full, partly wrong, nothing met, full
RESPONSES = ["take aspirin with water . rest .", "take aspirin with water . aspirin WRONG cures cancer .",
             "drink tea .", "rest . take aspirin with water . sleep ."]
#: the metric names a live check may have, after the trainer's prefix
LIVE_SUFFIXES = ({metric_name(c)[len(PREFIX):] for c in LIVE_CHECKS}
                 | {metric_name("mismatch.prefix_drift")[len(PREFIX):] + FIRST_TURN, TRAJECTORY_ESS})


# --------------------------------------------------------------------------------------------
# from the source: every module of the table does every duty


def _defined(path: Path) -> set[str]:
    """Names a module defines at top level (functions, classes, assignments; imports are not definitions)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _exported(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def missing_duties(path: Path) -> list[str]:
    """The duties of the contract ``path`` does not define or does not export in ``__all__``."""
    defined, exported = _defined(path), set(_exported(path))
    return [d for d in CONTRACT if d not in defined or d not in exported]


def test_the_table_lists_every_integration_module():
    modules = {p.stem for p in SRC.glob("*.py") if not p.stem.startswith("_")}
    assert set(INTEGRATIONS) == modules, "creditlab.integrations.INTEGRATIONS and the modules of the package differ"
    assert len(set(INTEGRATIONS)) == len(INTEGRATIONS)
    assert all(isinstance(v, str) and v for v in CONTRACT.values())


@pytest.mark.parametrize("name", INTEGRATIONS)
def test_every_integration_defines_and_exports_every_duty(name):
    path = SRC / f"{name}.py"
    assert missing_duties(path) == [], f"creditlab.integrations.{name} lacks duties of the contract"
    defined, exported = _defined(path), set(_exported(path))
    for old in OLD_NAMES[name]:  # the names before the contract are gone, not kept as aliases
        assert old not in defined and old not in exported, (name, old)


def test_the_duty_check_finds_a_missing_duty(tmp_path):
    source = (SRC / "verl.py").read_text()
    assert "\ndef live_metrics(" in source
    broken = tmp_path / "verl.py"
    broken.write_text(source.replace("\ndef live_metrics(", "\ndef live_metrics_gone("))
    assert missing_duties(broken) == ["live_metrics"]
    unexported = tmp_path / "trl.py"
    unexported.write_text((SRC / "trl.py").read_text().replace('"dump_rows", ', "", 1))
    assert missing_duties(unexported) == ["dump_rows"]


@pytest.mark.parametrize("name", INTEGRATIONS)
def test_every_integration_is_wired_into_the_package_and_its_docs(name):
    """What docs/contributing.md ("Adding a trainer") lists outside the module, for every integration."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="no tomllib on Python 3.10, and tomli is not installed")
    from packaging.requirements import Requirement

    from creditlab.cli.main import EXTRAS as CLI_EXTRAS

    root = SRC.parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert name in extras and name in {Requirement(r).name for r in extras[name]}, f"pyproject.toml: extra {name!r}"
    dev = next(Requirement(r) for r in extras["dev"] if Requirement(r).name == "creditlab")
    if name in OUTSIDE_DEV:
        assert name not in dev.extras, f"the dev extra cannot install {name}: {OUTSIDE_DEV[name]}"
    else:
        assert name in dev.extras, "the dev extra installs every trainer (the suite runs them)"
    assert CLI_EXTRAS.get(name) == name, "creditlab.cli.main.EXTRAS: the trainer's module -> its extra"
    readme = (root / "README.md").read_text()
    assert f"| `{name}` | `creditlab.integrations.{name}`" in readme, "README.md: a row in the extras table"
    doc = (root / "docs" / "integrations.md").read_text()
    assert f"| `creditlab.integrations.{name}` |" in doc, "docs/integrations.md: a row in the modules table"
    assert any(line.lower() == f"## {name}" for line in doc.splitlines()), f"docs/integrations.md: a ## {name} section"
    module = (SRC / f"{name}.py").read_text()
    assert f'import_trainer("{name}")' in module, "a missing trainer is one ImportError line naming the extra"


def test_importing_the_package_imports_no_trainer():
    code = ("import sys, creditlab.integrations as ci\n"
            "print(sorted(m for m in ('verl', 'trl', 'skyrl', 'skyrl_gym', 'ray', 'openrlhf') if m in sys.modules))\n"
            "print(sorted(m for m in sys.modules if m.startswith('creditlab.integrations.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["[]", "[]"], out.stdout
    with pytest.raises(ConfigError, match="integration: unknown 'nemo_rl'; valid: verl, trl, skyrl, openrlhf"):
        ci.integration("nemo_rl")


# --------------------------------------------------------------------------------------------
# one trainer batch per integration


@dataclass
class Case:
    """An integration and one batch of its trainer's own type, with what a duty call needs."""

    module: Any
    batch: Any
    dump_kwargs: dict = field(default_factory=dict)
    live_kwargs: dict = field(default_factory=dict)
    policy_tokens: list[int] = field(default_factory=list)  # per response, in batch order
    rewards: list[float] = field(default_factory=list)
    prefix: str = PREFIX  # of the live metrics
    set_version: Callable[[pytest.MonkeyPatch, str], None] = None  # the "installed" trainer version
    registered: Callable[[dict], None] = None  # asserts install()'s result is in the trainer's registries
    registries: Callable[[], Any] = None  # a snapshot of those registries
    fork: Callable[[str, list[str]], list[float]] = None  # the scores of the responses, shape checked
    fork_failure: Callable[[str], None] = None  # one judged response whose judge fails: never a 0
    #: the trainer's own correction path run with an arm and its parameters: its creditlab metrics (without
    #: the trainer's prefix), the (old, rollout, policy mask) it corrected, and its weights where it shows them
    correct: Callable[[str, dict], tuple[dict[str, float], tuple[torch.Tensor, ...], torch.Tensor | None]] = None


def _spec(arm: str, params: dict, prefix: str = "") -> str:
    """``<prefix><arm>[:key=value,...]``, the arm as a trainer config names it."""
    return prefix + arm + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")


def _unprefixed(metrics: Any, prefix: str) -> dict[str, float]:
    return {k[len(prefix):]: float(v) for k, v in dict(metrics).items() if k.startswith(prefix)}


def _resolve(dotted: str) -> Any:
    module, attr = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), attr)


def _verl_case(tmp_path_factory) -> Case:
    pytest.importorskip("verl", reason='verl is not installed (pip install "creditlab[verl]")')
    from verl import DataProto
    from verl.trainer.ppo import core_algos

    import creditlab.integrations.verl as cv

    B, L = 8, 32
    old, rollout, rm = agent_batch(0, B=B, L=L, mismatch=0.3)
    last = L - 1 - torch.argmax(rm.flip(1), dim=1)
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 1.0, 1.0]  # the second group is degenerate
    scores = torch.zeros(B, L)
    scores[torch.arange(B), last] = torch.tensor(rewards)
    attn = torch.cat([torch.ones(B, 5), (torch.arange(L)[None, :] <= last[:, None]).float()], 1)
    batch = DataProto.from_dict(
        tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": rm, "token_level_scores": scores,
                 "token_level_rewards": scores, "attention_mask": attn},
        non_tensors={"uid": np.array([f"p{i // 4}" for i in range(B)], dtype=object)}, meta_info={"global_steps": 3})

    def set_version(mp, v):
        mp.setattr(cv.verl, "__version__", v)

    def registered(out):
        assert set(out) == {"algorithm.rollout_correction.rollout_is", "algorithm.adv_estimator",
                            "actor_rollout_ref.actor.policy_loss.loss_mode", "wrapped"}
        assert {cv.parse_rollout_is(v)[0] for v in out["algorithm.rollout_correction.rollout_is"]} == \
            set(correction.CORRECTIONS)
        assert set(out["algorithm.adv_estimator"]) == {f"creditlab_{g}" for g in credit.GEOMETRIES}
        assert all(core_algos.ADV_ESTIMATOR_REGISTRY[n].__module__ == cv.__name__
                   for n in out["algorithm.adv_estimator"])
        assert core_algos.POLICY_LOSS_REGISTRY["creditlab_ppo"] is cv.compute_policy_loss_creditlab
        assert out["actor_rollout_ref.actor.policy_loss.loss_mode"] == ("creditlab_ppo",)
        assert out["wrapped"] and all(getattr(_resolve(p), "__creditlab_original__", None) is not None
                                      for p in out["wrapped"])

    def registries():
        return (dict(core_algos.ADV_ESTIMATOR_REGISTRY), dict(core_algos.POLICY_LOSS_REGISTRY),
                [_resolve(p) for p in cv.WRAPPED])

    def fork(url, responses):
        assert inspect.iscoroutinefunction(cv.fork_reward)  # verl's reward loop awaits it, once per sample

        async def all_samples():
            return await asyncio.gather(*(cv.fork_reward("medqa", r, RUBRICS, {"prompt": PROMPT, "index": i},
                                                         judge="openai", base_url=url, model="judge", max_retries=0)
                                          for i, r in enumerate(responses)))

        out = asyncio.run(all_samples())
        assert all(set(o) == {"score", "precision", "recall"} and all(type(v) is float for v in o.values())
                   for o in out)
        return [o["score"] for o in out]

    def fork_failure(url):
        with pytest.raises(CreditlabError, match="FORK reward of sample 0"):
            asyncio.run(cv.fork_reward("medqa", RESPONSES[0], RUBRICS, {"prompt": PROMPT, "index": 0}, judge="openai",
                                       base_url=url, model="judge", max_retries=0))

    def correct(arm, params):  # the driver-side entry point of decoupled mode, on a DataProto of its own
        from omegaconf import OmegaConf
        from verl.trainer.ppo import rollout_corr_helper

        own = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": rm})
        cfg = OmegaConf.create({"rollout_is": _spec(arm, params, cv.ROLLOUT_PREFIX), "rollout_is_threshold": 2.0,
                                "rollout_rs": None, "rollout_rs_threshold": None,
                                "rollout_is_batch_normalize": False, "bypass_mode": False})
        out, metrics = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(own, cfg)
        return (_unprefixed(metrics, "rollout_corr/creditlab/"), (old, rollout, rm.bool()),
                out.batch["rollout_is_weights"])

    return Case(cv, batch, policy_tokens=rm.sum(1).int().tolist(), rewards=rewards, prefix=cv.VERL_PREFIX,
                set_version=set_version, registered=registered, registries=registries, fork=fork,
                fork_failure=fork_failure, correct=correct)


def _length_reward(completions, **kwargs):
    return [float(len(c.split()) % 3) for c in completions]


def _trl_case(tmp_path_factory) -> Case:
    pytest.importorskip("trl", reason='TRL is not installed (pip install "creditlab[trl]")')
    import trl
    from datasets import Dataset
    from trl import GRPOConfig

    import creditlab.integrations.trl as ct

    G, prompts = 4, ["take aspirin", "drink tea"]
    tok = tiny_tokenizer()
    rf = make_rollout_func(tok)
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl") / "out"), per_device_train_batch_size=8,
                      num_generations=G, max_steps=1, learning_rate=1e-2, logging_steps=1, report_to="none",
                      save_strategy="no", use_cpu=True, max_completion_length=16, disable_tqdm=True, seed=0)
    tr = ct.CreditlabGRPOTrainer(model=tiny_model(), reward_funcs=_length_reward, args=args,
                                 train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                                 rollout_func=rf, correction="interq", live_checks=False)
    tr.model.train()
    torch.manual_seed(0)
    out = tr._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(G)])
    assert_engine_differs(rf)  # the engine's log-probs differ from the learner's: K3 > 0
    B = out["completion_ids"].shape[0]
    rewards, groups = tr._rewards(B), torch.arange(B) // G
    pm = out["completion_mask"].bool() & out["tool_mask"].bool()
    assert bool((out["completion_mask"].bool() & ~pm).any())  # tool tokens are there, and not policy tokens

    def set_version(mp, v):
        mp.setattr(trl, "__version__", v)

    def registered(out):
        assert out == {}  # TRL has no registry: creditlab is passed as objects

    def fork(url, responses):
        f = ct.fork_reward("openai", base_url=url, model="judge", max_retries=0)
        assert inspect.iscoroutinefunction(f) and f.__name__ == "fork"  # TRL logs rewards/<__name__>/...
        out = asyncio.run(f([PROMPT] * len(responses), list(responses), rubrics=[RUBRICS] * len(responses)))
        assert isinstance(out, list) and len(out) == len(responses) and all(type(v) is float for v in out)
        return out

    def fork_failure(url):
        f = ct.fork_reward("openai", base_url=url, model="judge", max_retries=0)
        assert asyncio.run(f([PROMPT], [RESPONSES[0]], rubrics=[RUBRICS])) == [None]  # TRL skips None

    def correct(arm, params):  # a generation batch of the trainer with the arm in its place
        saved = tr.creditlab_correction, tr.creditlab_correction_params
        tr.creditlab_correction, tr.creditlab_correction_params = arm, dict(params)
        try:
            o = tr._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(G)])
        finally:
            tr.creditlab_correction, tr.creditlab_correction_params = saved
        logged = {k: v[-1] for k, v in tr._metrics["train"].items() if k.startswith("creditlab/")}
        old = o["old_per_token_logps"]
        rollout = torch.where(torch.isnan(o["sampling_per_token_logps"]), old, o["sampling_per_token_logps"])
        return _unprefixed(logged, "creditlab/"), (old, rollout, o["completion_mask"].bool() & o["tool_mask"].bool()), \
            None

    return Case(ct, out, dump_kwargs={"rewards": rewards, "step": 0, "group_ids": groups},
                live_kwargs={"rewards": rewards, "group_ids": groups}, policy_tokens=pm.sum(1).tolist(),
                rewards=rewards.tolist(), set_version=set_version, registered=registered, registries=lambda: None,
                fork=fork, fork_failure=fork_failure, correct=correct)


def _skyrl_case(tmp_path_factory) -> Case:
    pytest.importorskip("skyrl", reason='SkyRL is not installed (pip install "creditlab[skyrl]")')
    from skyrl_ray_worker import load_backends_without_init

    load_backends_without_init()  # Python < 3.12: skyrl.backends without its package __init__
    import skyrl_gym
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.utils import ppo_utils
    from skyrl_gym.envs import registration

    import creditlab.integrations.skyrl as cs

    B, L = 8, 16
    old, rollout, lm = agent_batch(2, B=B, L=L, mismatch=0.3)
    response = torch.zeros_like(lm)
    for i in range(B):  # every response token, observations included, up to the last turn
        response[i, : int(lm[i].nonzero().max()) + 1] = 1
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 1.0, 1.0]
    rew = torch.zeros_like(lm)
    rew[torch.arange(B), L - 1 - torch.argmax(lm.flip(1), dim=1)] = torch.tensor(rewards)
    batch = TrainingInputBatch({"response_mask": response, "loss_mask": lm, "rewards": rew, "action_log_probs": old,
                                "rollout_logprobs": rollout})
    batch.metadata = {"uids": [f"p{i // 4}" for i in range(B)]}
    PL, AE = ppo_utils.PolicyLossRegistry, ppo_utils.AdvantageEstimatorRegistry

    def set_version(mp, v):
        mp.setattr(cs, "_skyrl_version", lambda: v)

    def registered(out):
        assert set(out) == {"trainer.algorithm.policy_loss_type", "trainer.algorithm.advantage_estimator",
                            "environment.env_class"}
        assert set(out["trainer.algorithm.policy_loss_type"]) == {f"creditlab_{a}" for a in correction.CORRECTIONS}
        assert set(out["trainer.algorithm.policy_loss_type"]) <= set(PL.list_available())
        assert set(out["trainer.algorithm.advantage_estimator"]) == {f"creditlab_{g}" for g in credit.GEOMETRIES}
        assert set(out["trainer.algorithm.advantage_estimator"]) <= set(AE.list_available())
        assert out["environment.env_class"] == ("creditlab_fork",) and "creditlab_fork" in registration.registry

    def registries():
        return dict(PL._functions), dict(AE._functions), set(registration.registry)

    def fork(url, responses):
        judge = {"judge": "openai", "base_url": url, "model": "judge", "max_retries": 0}
        out = [cs.fork_reward(PROMPT, r, RUBRICS, item_id=str(i), **judge) for i, r in enumerate(responses)]
        assert all(set(o) == {"score", "precision", "recall"} and all(type(v) is float for v in o.values())
                   for o in out)
        env = skyrl_gym.make("creditlab_fork", env_config={}, extras={"reward_spec": {"ground_truth": RUBRICS,
                                                                                      "judge": judge}})
        env.init([{"role": "user", "content": PROMPT}])
        assert env.step(responses[0])["reward"] == out[0]["score"]  # the environment calls it
        return [o["score"] for o in out]

    def fork_failure(url):
        with pytest.raises(CreditlabError, match="FORK reward of sample 0"):
            cs.fork_reward(PROMPT, RESPONSES[0], RUBRICS, item_id="0", judge="openai", base_url=url, model="judge",
                           max_retries=0)

    def correct(arm, params):  # the policy loss SkyRL's worker calls per micro-batch
        from omegaconf import OmegaConf

        cs.install()
        g = torch.Generator().manual_seed(3)
        lp = (old + 0.05 * torch.randn(old.shape, generator=g)).clamp(max=0).requires_grad_(True)
        adv = torch.randn(B, 1, generator=g).expand_as(old) * lm / lm.sum()
        opc = dict.fromkeys(("tis_ratio_type", "sequence_mask_metric", "outlier_token_is_threshold_low",
                             "outlier_token_is_threshold_high", "token_mask_is_threshold_low",
                             "token_mask_is_threshold_high"))
        cfg = OmegaConf.create({"eps_clip_low": 0.2, "eps_clip_high": 0.2, "clip_ratio_c": 3.0,
                                "off_policy_correction": opc, "creditlab": {"correction_params": dict(params)}})
        loss, metrics = PL.get(f"creditlab_{arm}")(lp, old, adv, config=cfg, loss_mask=lm, rollout_logprobs=rollout)
        loss.backward()
        assert bool(torch.isfinite(loss)) and bool(torch.isfinite(lp.grad).all())
        return _unprefixed(metrics, "creditlab/"), (old, rollout, lm.bool()), None

    return Case(cs, batch, policy_tokens=lm.sum(1).int().tolist(), rewards=rewards, set_version=set_version,
                registered=registered, registries=registries, fork=fork, fork_failure=fork_failure,
                correct=correct)


def _openrlhf_case(tmp_path_factory) -> Case:
    from openrlhf_loader import load_openrlhf

    mods = load_openrlhf()  # OpenRLHF 0.11.2's own modules (installed with --no-deps; skips if unreachable)
    import creditlab.integrations.openrlhf as co

    B, P, L, n = 8, 4, 16, 4
    old, rollout, lm = agent_batch(2, B=B, L=L, mismatch=0.3)
    # OpenRLHF's layout: the action tensors (B, T - 1) cover the sequence from its second token, so the
    # P - 1 prompt positions after the first come first (action_mask 0, log-probs 0 as its actor gives them)
    zeros = torch.zeros(B, P - 1)
    action_mask = torch.cat([zeros, lm], 1).bool()
    last = P - 1 + L - 1 - torch.argmax(lm.flip(1), dim=1)
    attention = torch.cat([torch.ones(B, 1), (torch.arange(P - 1 + L)[None, :] <= last[:, None]).float()], 1).long()
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 1.0, 1.0]  # the second group is degenerate
    batch = mods["experience"].Experience(
        sequences=torch.randint(5, 20, (B, P + L)), attention_mask=attention, action_mask=action_mask,
        action_log_probs=torch.cat([zeros, old * lm], 1), rollout_log_probs=torch.cat([zeros, rollout], 1),
        rewards=torch.tensor(rewards), index=list(range(B)), info={"reward": torch.tensor(rewards)})
    PolicyLoss = mods["loss"].PolicyLoss
    Maker = mods["experience_maker"].RemoteExperienceMaker

    def set_version(mp, v):
        mp.setattr(co, "_openrlhf_version", lambda: v)

    def registered(out):
        assert set(out) == {co.CORRECTION_ENV, "wrapped"}
        assert set(out[co.CORRECTION_ENV]) == set(correction.CORRECTIONS)
        assert out["wrapped"] == co.WRAPPED
        for wrapped in (PolicyLoss.__dict__["forward"], Maker.__dict__["compute_advantages_and_returns"]):
            assert getattr(wrapped, "__creditlab_original__", None) is not None

    def registries():
        return PolicyLoss.__dict__["forward"], Maker.__dict__["compute_advantages_and_returns"]

    def fork(url, responses):
        f = co.fork_reward("openai", base_url=url, model="judge", max_retries=0)
        k = len(responses)
        out = f([PROMPT + r for r in responses], [PROMPT] * k, [RUBRICS] * k)  # queries: prompt + response
        assert set(out) == {"rewards", "scores", "extra_logs"} and set(out["extra_logs"]) == {"fork/precision",
                                                                                             "fork/recall"}
        assert out["rewards"].shape == (k,) and out["rewards"].dtype == torch.float32
        return out["rewards"].tolist()

    def fork_failure(url):
        f = co.fork_reward("openai", base_url=url, model="judge", max_retries=0)
        with pytest.raises(CreditlabError, match="FORK reward of sample 0"):
            f([PROMPT + RESPONSES[0]], [PROMPT], [RUBRICS])

    def correct(arm, params):  # OpenRLHF's PolicyLoss with the arm named in its variable
        co.install()
        old_a, rollout_a = batch.action_log_probs, batch.rollout_log_probs
        g = torch.Generator().manual_seed(3)
        lp = (old_a + 0.05 * torch.randn(old_a.shape, generator=g) * action_mask).clamp(max=0).requires_grad_(True)
        adv = torch.randn(B, 1, generator=g).expand_as(old_a) * action_mask
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(co.CORRECTION_ENV, _spec(arm, params))
            loss_fn = PolicyLoss(is_correction_level="token")
            out = loss_fn(lp, old_a, adv, action_mask=action_mask, rollout_log_probs=rollout_a)
        out[0].backward()
        assert bool(torch.isfinite(out[0])) and bool(torch.isfinite(lp.grad).all())
        return _unprefixed(loss_fn.creditlab_metrics, "creditlab/"), (old_a, rollout_a, action_mask), None

    return Case(co, batch, dump_kwargs={"n_samples_per_prompt": n, "step": 0},
                live_kwargs={"n_samples_per_prompt": n}, policy_tokens=lm.sum(1).int().tolist(), rewards=rewards,
                set_version=set_version, registered=registered, registries=registries, fork=fork,
                fork_failure=fork_failure, correct=correct)


#: One builder per integration: a new trainer in INTEGRATIONS needs one here.
CASES: dict[str, Callable[[Any], Case]] = {"verl": _verl_case, "trl": _trl_case, "skyrl": _skyrl_case,
                                           "openrlhf": _openrlhf_case}
_BUILT: dict[str, Case] = {}


def test_every_integration_has_a_batch_builder_here():
    assert set(CASES) == set(INTEGRATIONS), ("add a builder of the new trainer's batch to CASES in "
                                             "tests/integrations/test_contract.py")


@pytest.fixture
def case(request, tmp_path_factory) -> Case:
    name = request.param
    if name not in _BUILT:
        _BUILT[name] = CASES[name](tmp_path_factory)
    return _BUILT[name]


def cases():
    return pytest.mark.parametrize("case", INTEGRATIONS, indirect=True)


# --------------------------------------------------------------------------------------------
# each duty, on each trainer


@cases()
def test_tested_versions_and_check_version(case, monkeypatch):
    m = case.module
    name = m.__name__.rsplit(".", 1)[1]
    assert isinstance(m.TESTED_VERSIONS, tuple) and m.TESTED_VERSIONS
    assert all(isinstance(v, str) and str(Version(v)) == v for v in m.TESTED_VERSIONS)
    assert m.ALLOW_UNTESTED_ENV == f"CREDITLAB_ALLOW_UNTESTED_{name.upper()}"
    monkeypatch.delenv(m.ALLOW_UNTESTED_ENV, raising=False)
    installed = m.check_version()
    assert installed == importlib.metadata.version(name) and installed in m.TESTED_VERSIONS
    assert [m.check_version(v) for v in m.TESTED_VERSIONS] == list(m.TESTED_VERSIONS)
    with pytest.raises(CreditlabError) as err:
        m.check_version("9.9.9")
    msg = str(err.value)
    assert "\n" not in msg and "found 9.9.9" in msg and f"{m.ALLOW_UNTESTED_ENV}=1" in msg, msg
    assert all(v in msg for v in m.TESTED_VERSIONS), msg
    case.set_version(monkeypatch, "9.9.9")
    with pytest.raises(CreditlabError, match="found 9.9.9"):
        m.check_version()  # the default is the installed version
    monkeypatch.setenv(m.ALLOW_UNTESTED_ENV, "1")
    assert m.check_version() == "9.9.9" == m.check_version("9.9.9")


@cases()
def test_install_is_idempotent_and_registers_what_it_returns(case, monkeypatch):
    m = case.module
    first = m.install()
    assert isinstance(first, dict) and all(isinstance(k, str) and isinstance(v, tuple) for k, v in first.items())
    assert all(isinstance(n, str) for v in first.values() for n in v)
    case.registered(first)
    before = case.registries()
    assert m.install() == first and case.registries() == before  # a second call changes nothing
    monkeypatch.delenv(m.ALLOW_UNTESTED_ENV, raising=False)
    case.set_version(monkeypatch, "9.9.9")
    with pytest.raises(CreditlabError, match="found 9.9.9"):
        m.install()
    assert case.registries() == before


@cases()
def test_dump_rows_are_rows_diagnose_reads(case, tmp_path):
    rows = case.module.dump_rows(case.batch, **case.dump_kwargs)
    assert isinstance(rows, list) and all(isinstance(r, dict) for r in rows)
    assert [sum(bool(x) for x in r["policy_mask"]) for r in rows] == case.policy_tokens
    assert [r["reward"] for r in rows] == pytest.approx(case.rewards)
    dump = read_dump(write_dump(rows, tmp_path / "dump.jsonl"))  # the reader validates every column
    assert len(dump.reward) == len(case.rewards) and dump.tokens is not None
    assert dump.reward.tolist() == pytest.approx(case.rewards)


@cases()
def test_live_metrics_are_namespaced_floats_equal_to_the_checks(case, tmp_path):
    live = case.module.live_metrics(case.batch, **case.live_kwargs)
    assert isinstance(live, dict) and live
    assert all(k.startswith(case.prefix) and k[len(case.prefix):] in LIVE_SUFFIXES for k in live), sorted(live)
    assert all(type(v) is float and math.isfinite(v) for v in live.values()), live
    k3, groups = case.prefix + "mismatch/k3", case.prefix + "baseline/degenerate_groups"
    assert live[k3] > 0 and groups in live
    rows = case.module.dump_rows(case.batch, **case.dump_kwargs)
    res = {r.id: r for r in run_checks(read_dump(write_dump(rows, tmp_path / "dump.jsonl")))}
    assert live[k3] == pytest.approx(res["mismatch.k3"].value, rel=1e-6)
    assert live[groups] == pytest.approx(res["baseline.degenerate_groups"].value, abs=1e-12)


@cases()
def test_fork_reward_has_the_trainers_reward_shape(case):
    from creditlab.integrations._common import cached_fork_reward
    from creditlab.judge.testing import ChatServer
    from creditlab.rewards.items import ForkItem, parse_rubrics

    with ChatServer() as srv:
        scores = case.fork(srv.url, RESPONSES)
        items = [ForkItem(str(i), f"user: {PROMPT}", r, parse_rubrics(RUBRICS, "test")) for i, r in
                 enumerate(RESPONSES)]
        direct = asyncio.run(cached_fork_reward("openai", base_url=srv.url, model="judge", max_retries=0)
                             .score(items))
        srv.push_faults(["500"])
        case.fork_failure(srv.url)
    assert scores == pytest.approx([d.reward for d in direct])  # FORK itself, whatever the shape
    assert scores[0] > scores[1] > scores[2] == 0.0  # precision penalises the wrong unit; nothing met is 0


#: built-in arms through each trainer: the baseline and InterQ-RL, and the arm composed of the two
ARMS_THROUGH_TRAINERS = [("tis", {"cap": 1.5}), ("interq", {"alpha_g": 0.4}),
                         ("interq_tis", {"alpha_g": 0.4, "cap": 1.5}), ("interq_tis", {})]


@cases()
@pytest.mark.parametrize("arm, params", ARMS_THROUGH_TRAINERS)
def test_builtin_arms_run_through_the_trainers_correction_path(case, arm, params):
    """The trainer looks the arm up in the registry by name: its weights (where the trainer shows them) and
    metrics are those of ``correction_weights`` on the tokens it corrected (float32 inputs; some trainers
    hand creditlab the log ratio in float64, hence the tolerance)."""
    got, (old, rollout, pm), weights = case.correct(arm, params)
    w, want = correction.correction_weights(arm, old, rollout, pm, params=params)
    assert bool((w[pm] != 1).any())  # the engine's log-probs differ: the weights are not all 1
    assert want.keys() <= got.keys(), sorted(want.keys() - got.keys())
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    if arm == "interq_tis":
        assert "correction/token_clip_rate" in got and "correction/rho_mean" in got
    if weights is not None:
        torch.testing.assert_close(weights[pm], w.to(weights.dtype)[pm], rtol=1e-5, atol=1e-6)


@cases()
def test_the_names_before_the_contract_are_gone(case):
    m = case.module
    for old in OLD_NAMES[m.__name__.rsplit(".", 1)[1]]:
        with pytest.raises(AttributeError, match=f"has no attribute '{old}'"):
            getattr(m, old)


@pytest.mark.parametrize("name", INTEGRATIONS)
def test_a_missing_trainer_is_one_line_naming_its_extra(name, monkeypatch):
    import sys

    from creditlab.integrations import import_trainer

    monkeypatch.setitem(sys.modules, name, None)  # import of it raises ModuleNotFoundError(name=name)
    want = rf'creditlab.integrations.{name} needs .*: pip install "creditlab\[{name}\]"'
    with pytest.raises(ImportError, match=want):
        import_trainer(name)


def test_a_module_missing_inside_an_installed_trainer_is_not_blamed_on_the_extra(monkeypatch):
    import importlib

    from creditlab.integrations import import_trainer

    def broken(module):
        raise ModuleNotFoundError("No module named 'flash_attn'", name="flash_attn")

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="flash_attn"):
        import_trainer("verl")
