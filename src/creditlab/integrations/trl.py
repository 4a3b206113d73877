"""creditlab inside TRL (tested with TRL 1.15.0 and 1.16.0): InterQ-RL weights, per-turn credit, FORK reward.

* :class:`CreditlabGRPOTrainer`: a ``GRPOTrainer`` that overrides one method,
  ``_generate_and_score_completions``, and post-processes its output:

  - **rollout correction**: from the rollout engine's log-probs (``sampling_per_token_logps``:
    vLLM, or a ``rollout_func`` returning ``logprobs``), the learner's ``old_per_token_logps``
    (computed here when TRL skipped them) and the policy mask ``completion_mask * tool_mask``
    (tool / environment tokens are 0), it computes InterQ-RL (or a baseline) weights ``W``. When
    TRL's own vLLM importance sampling is on, ``W`` replaces ``importance_sampling_ratio``;
    otherwise ``W`` is folded into per-token advantages ``A_t W_t``, which is the same loss:
    every GRPO loss type of TRL is positively homogeneous in the advantage
    (``-W min(r A, clip(r) A) = -min(r (W A), clip(r) (W A))`` for ``W > 0``).
  - **per-turn credit**: a credit geometry of :mod:`creditlab.core.credit` or PRM mixing on the
    turns (runs of policy tokens), with TRL's outcome advantage as ``A_i`` and per-turn scores
    from the sample field ``turn_scores`` (one number per turn, e.g. returned by a ``rollout_func``),
    given to TRL as ``(B, T)`` per-token advantages (which TRL accepts).

  Metrics are logged as ``creditlab/...``. Arms and geometries are looked up in creditlab's registries
  (:data:`creditlab.core.correction.CORRECTIONS`, :data:`creditlab.core.credit.GEOMETRIES`) when the
  trainer is built, so ones registered after import work.

  - **rollout dumps** (``dump=``): every training generation batch is written in the dump schema of
    ``creditlab diagnose`` (docs/diagnose.md): the engine's log-probs (``sampling_per_token_logps``),
    the learner's at the sampling checkpoint, the policy mask, the weighted reward, the group of each
    completion and its text.
  - **live checks** (``live_checks=True``): the values of diagnose's batch checks on every generation
    batch (``creditlab/mismatch/k3``, ``.../prefix_drift``, ``.../one_sided``, ``.../placeholder_logprobs``,
    ``.../nonfinite_logprobs``, ``.../sequence_ratio_length``, ``creditlab/baseline/degenerate_groups``:
    :mod:`creditlab.integrations._live`), kept as device tensors and read once per logging step with
    TRL's own metrics, and one warning line when a check crosses its warn threshold.

The trainer refuses a TRL version it was not tested with (:data:`TESTED_VERSIONS`, :func:`check_version`);
``CREDITLAB_ALLOW_UNTESTED_TRL=1`` lets another version through. The TRL internals it uses
(``_generate_and_score_completions``, ``_get_per_token_logps_and_entropies``, ``log``, ``_metrics``,
``_logs``) are the same in TRL 1.15.0 and 1.16.0. TRL 1.15.0's own log-prob kernel needs Triton on a
CUDA / XPU device (its GRPOTrainer does not run on CPU); 1.16.0 added a CPU path.
* :func:`fork_reward`: FORK as an async, batched GRPO reward function (``None`` where the judge
  failed, which TRL skips); precision and recall are logged as ``reward/fork/precision|recall``.
* :func:`dump_rows` and :func:`live_metrics`: the dump rows and the live check values of one output of
  ``_generate_and_score_completions`` (what the trainer writes and logs).

The names of the integration contract (:data:`creditlab.integrations.CONTRACT`): :data:`TESTED_VERSIONS`,
:data:`ALLOW_UNTESTED_ENV`, :func:`check_version`, :func:`install` (TRL has no registry: it checks the
version and registers nothing), :func:`dump_rows`, :func:`fork_reward`, :func:`live_metrics`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from creditlab.integrations import import_trainer

trl = import_trainer("trl")
from trl import GRPOTrainer

from creditlab.core import correction as _correction
from creditlab.core import credit as _credit
from creditlab.errors import ConfigError, CreditlabError, InputError
from creditlab.integrations._common import (
    CreditSettings,
    cached_fork_reward,
    check_tested_version,
    turn_credit,
    turn_layout,
)
from creditlab.integrations._live import LiveWarnings, batch_values, to_floats

__all__ = ["ALLOW_UNTESTED_ENV", "CORRECTIONS", "CREDITS", "TESTED_VERSIONS", "CreditlabGRPOTrainer",  # noqa: F822
           "check_version", "dump_rows", "fork_reward", "install", "live_metrics"]

#: TRL versions this module was tested against (``CREDITLAB_ALLOW_UNTESTED_TRL=1`` lets another through).
TESTED_VERSIONS = ("1.15.0", "1.16.0")
#: Set to ``1`` to let an untested TRL version through (:func:`check_version`).
ALLOW_UNTESTED_ENV = "CREDITLAB_ALLOW_UNTESTED_TRL"
#: Values of ``correction`` (``None``: leave TRL's ratio alone): the live registry of arms.
CORRECTIONS = _correction.CORRECTIONS
#: What TRL gives a credit geometry: its outcome advantages, per-turn scores from the samples, and
#: random keys (drawn from ``credit_settings.seed``).
_TRL_INPUTS = frozenset({"advantages", "step_scores", "keys"})


def _trl_can_feed(geometry: str) -> bool:
    """A geometry that spreads TRL's outcome advantage ``A_i`` and needs nothing TRL does not have (not
    ``binary`` / ``discretized``, which need the raw rewards, nor ``reward_to_go``, which ignores ``A_i``)."""
    needs = _credit.geometry_needs(geometry)
    return "advantages" in needs and needs <= _TRL_INPUTS


def _credits() -> tuple[str, ...]:
    """Registered geometries TRL can feed."""
    return tuple(g for g in _credit.GEOMETRIES if _trl_can_feed(g))


def __getattr__(name: str):
    if name == "CREDITS":  # values of ``credit`` (``None``: TRL's sequence advantage), a live view
        return _credits()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_version(version: str | None = None) -> str:
    """``version`` (default: the installed TRL's) when it is in :data:`TESTED_VERSIONS` or
    ``CREDITLAB_ALLOW_UNTESTED_TRL=1`` is set; otherwise a one-line :class:`CreditlabError` naming it
    (:class:`CreditlabGRPOTrainer` checks it when it is built)."""
    found = trl.__version__ if version is None else version
    return check_tested_version(__name__, "TRL", found, TESTED_VERSIONS, ALLOW_UNTESTED_ENV)


def install() -> dict[str, tuple[str, ...]]:
    """:func:`check_version`, and nothing to register: TRL has no registry for losses, advantages or
    rollout corrections, so creditlab comes in as objects you pass (:class:`CreditlabGRPOTrainer`, the
    reward function of :func:`fork_reward`). Returns ``{}`` (the integration contract's "what was
    registered"); idempotent."""
    check_version()
    return {}


class CreditlabGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with InterQ-RL rollout correction and per-turn credit (see the module docstring).

    Args (keyword-only, everything else goes to ``GRPOTrainer``):
        correction: a registered arm (:data:`CORRECTIONS`: ``interq``, ``prefix``, ``global``, ``tis``,
            ``mis``, ``seq_is``, ``geo``, ``none``, or one added with ``register_correction``) or None.
            Needs rollout log-probs (vLLM, or ``rollout_func``): with neither (``use_vllm=False`` and no
            ``rollout_func``) the trainer is refused when built, naming what to set.
        correction_params: keyword parameters of the arm (e.g. ``{"alpha_g": 0.5, "eps_low": 0.025}``).
        credit: a registered geometry TRL can feed (:data:`CREDITS`: ``uniform``, ``per_turn``,
            ``concentrated``, ``shuffled``, ``prm``, ``random_k``, ``targeted``, or one added with
            ``register_geometry`` that does not need the raw outcome rewards) or None.
        credit_settings: :class:`~creditlab.integrations._common.CreditSettings` or a dict of its
            fields (``conserve``, ``prm_lambda``, ``prm_schedule``...; the schedule runs on
            ``state.global_step``).
        turn_scores_key: the per-sample field holding one score per turn (list of floats).
        dump: where to write each training batch for ``creditlab diagnose``: a directory (one
            ``part-NNNNN.parquet`` per batch), or a ``*.jsonl`` / ``*.jsonl.gz`` / ``*.parquet`` file (appended
            to; an existing one must be a dump); checked here, with the rules of
            :func:`~creditlab.diagnose.schema.write_dump` (another name, e.g. ``dump.json`` or an existing
            file that is not a dump, is a :class:`ConfigError` naming ``dump``). With several processes each
            writes under ``rank-<i>/`` of a directory, or to ``<name>.rank-<i>.<suffix>``. None: no dump.
        live_checks: log the values of diagnose's batch checks every step (``creditlab/...``) and warn
            once when one crosses its warn threshold. The mismatch values need the learner's log-probs
            of the sampling checkpoint: they are there when TRL computes them (vLLM importance
            sampling) or creditlab does (``correction`` or ``dump``); no extra forward is run for them.
    """

    def __init__(self, *args: Any, correction: str | None = "interq", correction_params: dict | None = None,
                 credit: str | None = None, credit_settings: CreditSettings | dict | None = None,
                 turn_scores_key: str = "turn_scores", dump: str | os.PathLike | None = None,
                 live_checks: bool = True, **kwargs: Any):
        check_version()
        if correction is not None:
            _correction.get_correction(correction)
        if credit is not None:
            if credit not in _credit.GEOMETRIES:  # the registry's error would list geometries TRL cannot feed
                raise ConfigError("credit", f"unknown {credit!r}; valid: {', '.join(_credits())} or None")
            if not _trl_can_feed(credit):
                needs = sorted(_credit.geometry_needs(credit))
                raise ConfigError("credit", f"{credit!r} needs {needs}: TRL passes its outcome advantages and per-turn "
                                            f"scores; valid: {', '.join(_credits())} or None")
        if dump is not None:  # what the first training step would write to, checked now
            from creditlab.diagnose.schema import check_dump_path

            check_dump_path(dump, name="dump")
        self.creditlab_correction = correction
        self.creditlab_correction_params = dict(correction_params or {})
        self.creditlab_credit = credit
        if isinstance(credit_settings, CreditSettings):
            self.creditlab_credit_settings = credit_settings
        else:
            self.creditlab_credit_settings = CreditSettings.from_mapping(credit_settings, "credit_settings")
        self.creditlab_turn_scores_key = turn_scores_key
        self.creditlab_dump = dump
        self.creditlab_live_checks = bool(live_checks)
        self._creditlab_live: dict[str, dict[str, list[torch.Tensor]]] = {"train": {}, "eval": {}}
        self._creditlab_warnings = LiveWarnings()
        if correction is not None:  # fail before the (slow) trainer construction on a bad parameter
            try:
                self._weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
                              diagnostics=False)
            except InputError as err:
                raise ConfigError("correction_params", f"{err} (arm {correction!r})") from None
        super().__init__(*args, **kwargs)
        if correction is not None and not self.use_vllm and self.rollout_func is None:
            raise ConfigError("correction", f"{correction!r} needs the rollout engine's log-probs, and TRL's plain "
                                            "transformers generation gives none (use_vllm=False, no rollout_func): "
                                            "set use_vllm=True in GRPOConfig, pass a rollout_func that returns "
                                            "'logprobs', or pass correction=None")
        if dump is not None and self.accelerator.num_processes > 1:
            from creditlab.diagnose.schema import check_dump_path

            check_dump_path(self._dump_path(), name="dump")
        if correction is not None and self.loss_type == "vespo":
            raise ConfigError("correction", "the 'vespo' loss computes its own importance weights")

    # -- the one overridden method -------------------------------------------------------------
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        out = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        self._creditlab_old = None
        if self.creditlab_dump is not None and mode == "train":
            self._dump(out, mode)
        completion_mask = out["completion_mask"]
        pm = completion_mask.bool()
        if "tool_mask" in out:
            pm = pm & out["tool_mask"].bool()
        if self.creditlab_correction is None and self.creditlab_credit is None:
            self._live_values(out, pm, mode)
            return out
        metrics: dict[str, float] = {}
        token_adv = None
        if self.creditlab_credit is not None:
            token_adv = self._turn_advantages(inputs, out["advantages"], pm)
        if self.creditlab_correction is not None:
            rollout = out.get("sampling_per_token_logps")
            if rollout is None:
                raise ConfigError("correction", "needs the rollout engine's log-probs: generate with vLLM or with a "
                                                "rollout_func that returns 'logprobs'")
            old = out.get("old_per_token_logps")
            if old is None:
                old = self._creditlab_old if self._creditlab_old is not None else self._old_logps(out, mode)
                out["old_per_token_logps"] = old
            # tokens the engine could not score (NaN) get no correction, as in TRL
            rollout = torch.where(torch.isnan(rollout), old, rollout)
            w, m = self._weights(old, rollout, pm)  # the arm's and mismatch_metrics', one InterQ pass
            metrics.update({f"creditlab/{k}": v for k, v in m.items()})
            w = w.to(out["advantages"].dtype)
            if "importance_sampling_ratio" in out:
                out["importance_sampling_ratio"] = w
            else:
                base = token_adv if token_adv is not None else out["advantages"][:, None].expand_as(w)
                token_adv = base * w
        if token_adv is not None:
            out["advantages"] = token_adv
        live = self._live_values(out, pm, mode)
        for k, v in metrics.items():
            if k not in live and math.isfinite(v):  # a live check's value replaces the arm's (one name, one value)
                self._metrics[mode][k].append(v)
        return out

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's ``log``, with the live check values of the logging window read in one host read, averaged
        like TRL's metrics, and checked against their warn thresholds (training only)."""
        mode = "train" if self.model.training else "eval"
        buf = self._creditlab_live[mode]
        if buf:
            keys = list(buf)
            stacked = torch.stack([v for k in keys for v in buf[k]])
            if self.accelerator.num_processes > 1:  # the processes' mean, as TRL's own metrics
                stacked = self.accelerator.gather(stacked[None]).nanmean(0)
            flat = stacked.tolist()  # one host read per logging step
            means, i = {}, 0
            for k in keys:
                vals = [v for v in flat[i:i + len(buf[k])] if math.isfinite(v)]
                i += len(buf[k])
                self._metrics[mode][k].extend(vals)
                means[k] = sum(vals) / len(vals) if vals else math.nan
            buf.clear()
            if mode == "train" and self.accelerator.is_main_process:
                self._creditlab_warnings.observe(means, step=int(self.state.global_step))
        super().log(logs, start_time)

    _creditlab_old: torch.Tensor | None = None  # learner log-probs computed by the dump, reused by the correction
    _creditlab_dump_step: int | None = None  # the global step of the last dumped batch
    _creditlab_group_base = 0  # groups of that step dumped before the next batch (group ids continue from it)

    def _group_ids(self, B: int, mode: str, device: torch.device | None = None) -> torch.Tensor:
        """TRL's group of each of this process's ``B`` completions of a generation batch: TRL gathers the
        batch over processes (in process order) and forms its groups from ``num_generations``
        (``num_generations_eval`` in eval) consecutive completions of it (``rewards.view(-1, G)``)."""
        G = self.num_generations if mode == "train" else (getattr(self, "num_generations_eval", None)
                                                          or self.num_generations)
        start = self.accelerator.process_index * B
        return (torch.arange(B, device=device) + start) // G

    # -- helpers -------------------------------------------------------------------------------
    def _rewards(self, B: int) -> torch.Tensor | None:
        """``(B,)`` float64 weighted reward of this process's completions of the batch (TRL's ``nansum`` of
        the reward functions), NaN where no function could score (from TRL's logged per-function rewards;
        None when its log holds fewer than the batch, e.g. an eval batch larger than a generation batch)."""
        n_all = B * self.accelerator.num_processes
        start = self.accelerator.process_index * B
        logged = [list(self._logs["rewards"][name])[-n_all:][start:start + B] for name in self.reward_func_names]
        if any(len(v) != B for v in logged):
            return None
        per_func = torch.tensor(logged, dtype=torch.float64).T  # (B, n_funcs)
        weights = self.reward_weights.detach().cpu().to(torch.float64)
        rewards = torch.where(torch.isnan(per_func), 0.0, per_func * weights).sum(1)
        return torch.where(torch.isnan(per_func).all(1), math.nan, rewards)

    def _live_values(self, out: dict[str, Any], pm: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
        """The live check values of this batch, kept as device tensors until :meth:`log` (no host read)."""
        if not self.creditlab_live_checks:
            return {}
        old = out.get("old_per_token_logps")
        if old is None:
            old = self._creditlab_old
        groups = self._group_ids(pm.shape[0], mode)  # TRL's groups, numbered from 0 on this process
        values = _live_tensors(out, self._rewards(pm.shape[0]), group_ids=groups - groups[:1].sum(),
                               old_logprobs=old, policy_mask=pm)
        buf = self._creditlab_live[mode]
        for k, v in values.items():
            buf.setdefault(k, []).append(v.detach())
        return values

    def _dump(self, out: dict[str, Any], mode: str) -> None:
        """Write this process's completions of the batch as dump rows (see :func:`dump_rows`)."""
        from creditlab.diagnose.schema import write_dump

        old = out.get("old_per_token_logps")
        if old is None and out.get("sampling_per_token_logps") is not None:
            old = self._creditlab_old = self._old_logps(out, mode)
        B = out["completion_ids"].shape[0]
        n_all = B * self.accelerator.num_processes
        start = self.accelerator.process_index * B
        rewards = self._rewards(B)  # NaN: unscorable, dropped below
        if rewards is None:
            raise CreditlabError(f"dump: TRL's reward log holds fewer than the batch's {B} completions")
        completions = list(self._logs["completion"])[-n_all:][start:start + B]
        step = int(self.state.global_step)
        # TRL generates several batches at one global step when steps_per_generation <
        # gradient_accumulation_steps (each with its own groups numbered from 0): a step's later batches
        # continue its numbering, so each (step, group) is one of TRL's groups
        if self._creditlab_dump_step != step:
            self._creditlab_dump_step, self._creditlab_group_base = step, 0
        groups = self._creditlab_group_base + self._group_ids(B, mode)
        self._creditlab_group_base += -(-n_all // self.num_generations)  # the batch's groups, all processes
        rows = dump_rows(out, rewards, step=step, old_logprobs=old, group_ids=groups,
                         responses=completions if all(isinstance(c, str) for c in completions) else None)
        if rows:
            write_dump(rows, self._dump_path(), append=True)

    def _dump_path(self) -> Path:
        """The dump of this process: ``dump`` itself with one process; with several, ``rank-<i>/`` under a
        directory, or ``<name>.rank-<i>.<suffix>`` for a dump file (one writer per file)."""
        path = Path(self.creditlab_dump)
        if self.accelerator.num_processes == 1:
            return path
        rank = self.accelerator.process_index
        for suffix in (".jsonl.gz", ".jsonl", ".parquet"):
            if path.name.endswith(suffix):
                return path.with_name(f"{path.name[:-len(suffix)]}.rank-{rank}{suffix}")
        return path / f"rank-{rank}"

    def _weights(self, old: torch.Tensor, rollout: torch.Tensor, pm: torch.Tensor, *, diagnostics: bool = True):
        """The arm's weights and metrics (with :func:`~creditlab.core.correction.mismatch_metrics` when
        ``diagnostics``), from the registry at call time."""
        return _correction.correction_weights(self.creditlab_correction, old, rollout, pm,
                                              params=self.creditlab_correction_params, diagnostics=diagnostics)

    def _old_logps(self, out: dict[str, Any], mode: str) -> torch.Tensor:
        """Learner log-probs of the sampling checkpoint (TRL skips them when it can use the detached
        current ones; InterQ-RL needs them before the update)."""
        input_ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention_mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        bs = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        with torch.no_grad():
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, out["completion_ids"].size(1), batch_size=bs)
        return logps.detach()

    def _turn_advantages(self, inputs: list[dict[str, Any]], advantages: torch.Tensor, pm: torch.Tensor
                         ) -> torch.Tensor:
        lay = turn_layout(pm)
        B, T = lay.step_mask.shape
        key = self.creditlab_turn_scores_key
        scores = None
        if "step_scores" in _credit.geometry_needs(self.creditlab_credit):
            scores = torch.zeros(B, T, dtype=torch.float64)
            n_turns = lay.seg.n_segments.tolist()
            for i, example in enumerate(inputs):
                if key not in example:
                    raise InputError(f"{key}: sample {i} has no per-turn scores (credit {self.creditlab_credit!r})")
                vals = [float(v) for v in example[key]]
                if len(vals) != n_turns[i]:
                    raise InputError(f"{key}: sample {i} has {len(vals)} scores for {n_turns[i]} turns")
                scores[i, : len(vals)] = torch.tensor(vals, dtype=torch.float64)
            scores = scores.to(device=pm.device)
        mode = "train" if self.model.training else "eval"
        group_ids = self._group_ids(B, mode, device=pm.device)
        a = turn_credit(self.creditlab_credit, lay.step_mask, group_ids, advantages=advantages.to(torch.float64),
                        step_scores=scores, step=int(self.state.global_step), settings=self.creditlab_credit_settings)
        return lay.to_tokens(a).to(advantages.dtype)


def dump_rows(out: dict[str, Any], rewards: torch.Tensor, *, step: int, group_ids: torch.Tensor,
              old_logprobs: torch.Tensor | None = None, responses: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Dump rows (docs/diagnose.md) of one output of TRL's ``_generate_and_score_completions``.

    The policy mask is ``completion_mask * tool_mask`` (tool / environment tokens are 0) and the
    tokens kept are the completion's (``completion_mask``). The token columns need the engine's
    ``sampling_per_token_logps`` and the learner's ``old_logprobs`` (default: ``out["old_per_token_logps"]``);
    without them the rows carry only step, group, reward and length. Rows whose reward is NaN (no
    reward function could score them) are left out.
    """
    from creditlab.diagnose.schema import rows_from_arrays

    cm = out["completion_mask"].detach().cpu().bool()
    pm = _policy_mask(out).detach().cpu()
    old = old_logprobs if old_logprobs is not None else out.get("old_per_token_logps")
    rollout = out.get("sampling_per_token_logps")
    token: dict[str, Any] = {}
    if old is not None and rollout is not None:
        token = {"logprobs": old.detach().cpu().double(), "rollout_logprobs": rollout.detach().cpu().double(),
                 "policy_mask": pm, "valid_mask": cm}
    extra = {"response": list(responses)} if responses is not None else {}
    rows = rows_from_arrays(step=step, group_ids=group_ids, rewards=torch.nan_to_num(rewards.double(), nan=0.0),
                            response_length=pm.sum(1), **token, **extra)
    keep = (~torch.isnan(rewards)).tolist()
    return [r for r, k in zip(rows, keep, strict=True) if k]


def _policy_mask(out: dict[str, Any]) -> torch.Tensor:
    """``completion_mask * tool_mask`` as bool (tool / environment tokens are 0)."""
    pm = out["completion_mask"].bool()
    return pm & out["tool_mask"].bool() if "tool_mask" in out else pm


def _live_tensors(out: dict[str, Any], rewards: torch.Tensor | None, *, group_ids: torch.Tensor | None,
                 old_logprobs: torch.Tensor | None, policy_mask: torch.Tensor | None = None
                 ) -> dict[str, torch.Tensor]:
    """The live check values of one output as 0-dim device tensors (no host read)."""
    pm = _policy_mask(out) if policy_mask is None else policy_mask
    old = old_logprobs if old_logprobs is not None else out.get("old_per_token_logps")
    return batch_values(old, out.get("sampling_per_token_logps"), pm,
                        group_ids=None if group_ids is None else group_ids.to(pm.device),
                        rewards=None if rewards is None else rewards.to(pm.device))


def live_metrics(out: dict[str, Any], rewards: torch.Tensor | None = None, *, group_ids: torch.Tensor | None = None,
                 old_logprobs: torch.Tensor | None = None) -> dict[str, float]:
    """The live check values (:mod:`creditlab.integrations._live`) of one output of TRL's
    ``_generate_and_score_completions``, as the ``creditlab/<check>`` floats :class:`CreditlabGRPOTrainer`
    logs, read in one host read (NaN ones left out).

    The mismatch checks need the engine's ``sampling_per_token_logps`` and the learner's ``old_logprobs``
    (default: ``out["old_per_token_logps"]``) on the policy mask ``completion_mask * tool_mask``;
    ``baseline/degenerate_groups`` needs the ``(B,)`` ``rewards`` and ``group_ids`` (the trainer's: TRL's
    weighted reward and blocks of ``num_generations`` completions). What is missing is not computed.
    """
    values = to_floats(_live_tensors(out, rewards, group_ids=group_ids, old_logprobs=old_logprobs))
    return {k: v for k, v in values.items() if v == v}


def fork_reward(judge: str = "offline", *, name: str = "fork", **options: Any):
    """An async, batched TRL reward function computing FORK (``name`` is the logged reward name).

    ``options`` are those of :func:`creditlab.integrations._common.cached_fork_reward` (``base_url``,
    ``model``, ``beta``, ``tau``, ``mode``, ``assume_correct``...). The rubrics come from the dataset
    column ``rubrics`` (one list of ``{"criterion", "points"}`` records per sample). All completions
    of a step go to the judge in one batched call; a completion whose judging failed gets ``None``.
    """
    reward = cached_fork_reward(judge, **options)

    async def fork(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        from creditlab.rewards.fork import trl_items

        results = await reward.score(trl_items(prompts, completions, **kwargs))
        log_metric = kwargs.get("log_metric")
        if log_metric is not None:
            for field in ("precision", "recall"):
                vals = [getattr(r, field) for r in results if r.reward is not None]
                if vals:
                    log_metric(f"reward/{name}/{field}", sum(vals) / len(vals))
            log_metric(f"reward/{name}/failures", sum(r.reward is None for r in results) / max(len(results), 1))
        return [r.reward for r in results]

    fork.__name__ = fork.__qualname__ = name
    fork.fork_reward = reward
    return fork
