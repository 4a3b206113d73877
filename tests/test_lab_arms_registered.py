"""Every arm a lab trains is a component a trainer integration can name: a credit geometry
(``GEOMETRIES``, verl's ``creditlab_<name>`` estimators, TRL's ``credit=``, SkyRL's advantage estimators),
a correction arm (``CORRECTIONS``), a schedule kind (``SCHEDULES``, the integrations' ``prm_schedule``),
a FORK combine mode (``COMBINE_MODES``, the integrations' FORK reward ``mode``), or the trainers' own
outcome GRPO. A lab result is then a result about what users install.

The arms are read from the cells a lab would run (every experiment selected, quick and full configs), so
an arm added to a lab without a registered component fails here. The one family no integration offers
yet, on-policy self-distillation, is listed by name: adding another such arm fails too.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from creditlab.core.correction import CORRECTIONS
from creditlab.core.credit import GEOMETRIES
from creditlab.core.precision import COMBINE_MODES
from creditlab.core.schedules import SCHEDULES
from creditlab.labs import BUILTIN, get_lab

#: Arms no trainer integration offers (the OPSD loss lives in core.losses, without a trainer plug-in).
NOT_IN_ANY_INTEGRATION = {("granularity", "opsd_ref"), ("granularity", "opsd_advice")}


def _walk(x, path=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(x, list | tuple):
        for v in x:
            yield from _walk(v, f"{path}[]")
    else:
        yield path, x


def _configs(lab):
    quick = lab.config_type.quick()
    full = lab.config_type()
    every = getattr(lab.config_type, "EXPERIMENTS", None)
    out = [quick, full]
    if every:
        out += [replace(quick, experiments=tuple(every)), replace(full, experiments=tuple(every))]
    return out


def _arms(lab_name):
    """``(field, value)`` of every arm-like argument of every cell the lab makes."""
    lab = get_lab(lab_name)
    seen = set()
    for cfg in _configs(lab):
        for cell in lab.cells(cfg):
            for path, value in _walk(cell.kwargs):
                leaf = path.rsplit(".", 1)[-1].replace("[]", "")
                if leaf in ("arm", "arms", "map_arms", "noise_arms", "pitfall_arms", "advantage", "correction"):
                    seen.add((leaf, str(value)))
    return seen


def _components(lab_name, field, value):
    """The registered components ``(registry, name)`` an arm resolves to (KeyError: it does not)."""
    if field == "advantage":  # GRPOConfig.advantage: outcome GRPO or a registered geometry
        return [("grpo", "outcome")] if value == "grpo" else [("GEOMETRIES", GEOMETRIES.get(value) and value)]
    if field == "correction":
        return [("CORRECTIONS", CORRECTIONS.get(value) and value)]
    if lab_name == "coverage":
        return [("GEOMETRIES", GEOMETRIES.get(value) and value)]
    if lab_name == "fork":
        from creditlab.train.bagofunits import reward_of

        mode, _ = reward_of(value, 1.0)
        if mode not in COMBINE_MODES:
            raise KeyError(mode)
        return [("COMBINE_MODES", mode)]
    if lab_name == "mismatch":
        from creditlab.core.correction import parse_correction
        from creditlab.labs.mismatch.config import ARMS
        from creditlab.labs.mismatch.planted import PLANTED_ARMS

        # a dose arm (ARMS) or a planted arm (PLANTED_ARMS); its correction is a spec ``arm[:key=value,...]``
        spec = ARMS[value][2] if value in ARMS else PLANTED_ARMS[value]
        name, _ = parse_correction(spec)
        return [("CORRECTIONS", CORRECTIONS.get(name) and name)]
    if lab_name == "granularity":
        from creditlab.labs.granularity.config import ARMS, GranularityConfig

        kind, _ = ARMS[value]
        if kind == "grpo":
            return [("grpo", "outcome")]
        if kind == "prm":
            schedule = GranularityConfig().schedule(value)
            return [("GEOMETRIES", GEOMETRIES.get("prm") and "prm"), ("SCHEDULES", SCHEDULES.get(schedule.kind) and
                                                                       schedule.kind)]
        if (lab_name, value) in NOT_IN_ANY_INTEGRATION:
            return []
    raise KeyError(f"{lab_name}: no rule resolves {field}={value!r}")


@pytest.mark.parametrize("lab_name", list(BUILTIN))
def test_every_lab_arm_resolves_through_a_registry(lab_name):
    arms = _arms(lab_name)
    assert arms, f"{lab_name}: no arm found in its cells (the walk is broken)"
    unresolved = []
    for field, value in sorted(arms):
        comps = _components(lab_name, field, value)
        if not comps and (lab_name, value) not in NOT_IN_ANY_INTEGRATION:
            unresolved.append(value)
    assert not unresolved, f"{lab_name}: arms without a registered component: {unresolved}"


def test_the_known_gaps_are_still_arms():
    """The exception list names arms the granularity lab really trains (so it cannot hide a renamed arm)."""
    seen = {v for _, v in _arms("granularity")}
    assert {a for _, a in NOT_IN_ANY_INTEGRATION} <= seen


def test_an_arm_without_a_registered_component_is_caught():
    with pytest.raises(Exception, match="unknown 'nope'"):
        _components("coverage", "arm", "nope")
    with pytest.raises(Exception, match="unknown 'nope'"):
        _components("toolshop", "correction", "nope")


def test_the_prm_arms_run_the_registered_geometry_with_their_schedule(monkeypatch):
    """The granularity lab's PRM arms call the registered ``prm`` geometry (not a copy of its math), with
    the weight of the arm's Schedule at each update."""
    import torch

    from creditlab.labs.granularity.config import GranularityConfig
    from creditlab.train.toolshop_grpo import make_advantage

    calls = []
    real = GEOMETRIES["prm"]

    def spy(batch, *, conserve=True, lam=0.5, eps=1e-6):
        calls.append(lam)
        return real(batch, conserve=conserve, lam=lam, eps=eps)

    monkeypatch.setitem(GEOMETRIES._items, "prm", spy)
    cfg = GranularityConfig()
    adv = make_advantage("prm", conserve=False, step_scores=lambda b: torch.ones(2, 1), lam=cfg.schedule("prm_decay"))

    class _Batch:  # a rollout batch of two one-turn rollouts: only its groups are read (turn helpers stubbed)
        group_ids = torch.tensor([0, 0])

    monkeypatch.setattr("creditlab.train.toolshop_grpo.turn_mask_of", lambda b: torch.ones(2, 1, dtype=torch.bool))
    monkeypatch.setattr("creditlab.train.toolshop_grpo.turns_to_tokens", lambda a, b: a)
    for k in (0, 25, 40):
        adv(_Batch(), torch.tensor([1.0, 0.0]), k)
    assert calls == [cfg.schedule("prm_decay")(k) for k in (0, 25, 40)] and calls[0] > calls[1] > calls[2] == 0
