"""Base-policy builds: an interrupted build resumes with the weights of an uninterrupted one, reports
its steps and time left without a terminal, and shipped base policies are found after the cache."""

import io
import json

import pytest
import torch

from creditlab.errors import ConfigError
from creditlab.train import toolshop_base
from creditlab.train.toolshop_base import (
    BaseConfig,
    BuildReport,
    base_file,
    base_policy,
    prepare_base_policy,
    resume_step,
    ship_base_policy,
    train_base,
)

# thoughts: the imitation loss's two-part path; 24 steps: past the warm-up (1 step) into the cosine decay
CFG = BaseConfig(n_demos=32, steps=24, batch_size=8, d_model=16, n_layer=1, max_len=96, chain_lengths=(2, 3),
                 thoughts=2)


class Stop(Exception):
    pass


def _stop_after(n: int):
    def progress(k, loss):
        if k + 1 == n:
            raise Stop

    return progress


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_resumed_build_has_the_weights_of_an_uninterrupted_one(tmp_path):
    whole = train_base(CFG)
    state = tmp_path / "state.pt"
    with pytest.raises(Stop):  # interrupted after step 10; the state saved after every step (resume_every_s=0)
        train_base(CFG, _stop_after(10), resume=state, resume_every_s=0)
    assert torch.load(state, weights_only=True)["step"] == 9  # step 10's state was not saved: it raised first
    with pytest.raises(Stop):  # interrupted again, later
        train_base(CFG, _stop_after(17), resume=state, resume_every_s=0)
    steps = []
    resumed = train_base(CFG, lambda k, loss: steps.append(k), resume=state, resume_every_s=0)
    assert steps == list(range(16, CFG.steps))  # continued where the state was, not from the start
    assert _same(resumed, whole)  # bit for bit


def test_ctrl_c_stops_a_build_at_the_end_of_a_step_and_saves_its_state(tmp_path):
    import os
    import signal

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("this process does not have Python's default Ctrl-C handler")
    whole = train_base(CFG)
    state = tmp_path / "state.pt"

    def ctrl_c_at_step_8(k, loss):
        if k + 1 == 8:
            os.kill(os.getpid(), signal.SIGINT)  # delivered in the middle of the loop, held to the step's end

    with pytest.raises(KeyboardInterrupt, match="interrupted after step 8 of 24; its state is saved"):
        train_base(CFG, ctrl_c_at_step_8, resume=state, resume_every_s=1e9)  # no timed save: only Ctrl-C's
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    assert torch.load(state, weights_only=True)["step"] == 8
    steps = []
    resumed = train_base(CFG, lambda k, loss: steps.append(k), resume=state, resume_every_s=1e9)
    assert steps[0] == 8 and _same(resumed, whole)


def test_an_interrupted_cached_build_resumes_and_cleans_up(tmp_path, monkeypatch):
    whole = base_policy(CFG, cache_dir=None)
    monkeypatch.setattr(toolshop_base, "RESUME_EVERY_S", 0.0)  # a state after every step
    with pytest.raises(Stop):
        toolshop_base._build(CFG, tmp_path, _stop_after(12))
    assert resume_step(CFG, tmp_path) == 11 and base_file(CFG, tmp_path) is None
    steps = []
    model = base_policy(CFG, cache_dir=tmp_path, progress=lambda k, loss: steps.append(k))
    assert steps[0] > 0 and steps[-1] == CFG.steps - 1
    assert _same(model, whole)
    assert [p.name for p in tmp_path.iterdir()] == [f"toolshop-base-{CFG.key()}.safetensors"]  # the state is gone
    assert resume_step(CFG, tmp_path) == 0


def test_a_state_of_another_config_is_refused(tmp_path):
    state = tmp_path / "state.pt"
    with pytest.raises(Stop):
        train_base(CFG, _stop_after(3), resume=state, resume_every_s=0)
    other = BaseConfig(**{**CFG.__dict__, "lr": 1e-3})
    with pytest.raises(ConfigError, match="base: .*another config"):
        train_base(other, resume=state)


def test_the_report_prints_steps_and_time_left_without_a_terminal():
    clock = iter(float(t) for t in range(100))
    out = io.StringIO()  # not a terminal
    report = BuildReport("test base", 20, cache_dir=None, stream=out, clock=lambda: next(clock))
    for k in range(20):  # one second per step
        report(k, 0.5)
    lines = out.getvalue().splitlines()
    assert lines[0] == ("test base: building: 20 optimizer steps (an interrupted build resumes from its last saved "
                        "state)")
    assert len(lines) == 1 + 10  # every 10% of the steps
    assert lines[5] == "test base: step 10/20 (50%), loss 0.500, 10 s so far, about 10 s left"
    assert lines[-1] == "test base: step 20/20 (100%), loss 0.500, 20 s so far, about 0 s left"
    report.interrupted(12)
    report.interrupted(0)
    assert out.getvalue().splitlines()[-2:] == [
        "test base: interrupted; 12 of 20 steps are saved: run the same command again to continue from there",
        "test base: interrupted before its first saved state: a rerun starts it again"]


def test_the_report_of_a_resumed_build_counts_its_own_rate():
    clock = iter(float(t) for t in range(0, 1000, 2))  # two seconds per step
    out = io.StringIO()
    report = BuildReport("b", 200, start=150, stream=out, every=10, every_s=1e9, clock=lambda: next(clock))
    for k in range(150, 160):
        report(k, 1.0)
    first, line = out.getvalue().splitlines()
    assert first.startswith("b: resuming at step 150/200")
    assert line == "b: step 160/200 (80%), loss 1.000, 20 s so far, about 1 min 20 s left"  # 40 steps x 2 s


def test_the_report_prints_at_least_every_every_s():
    ticks = iter([0.0, 5.0, 61.0, 100.0, 122.0])
    out = io.StringIO()
    report = BuildReport("b", 1000, stream=out, every_s=60.0, clock=lambda: next(ticks))
    for k in range(4):  # at 5 s: nothing; 61 s: a line; 100 s: nothing (39 s since); 122 s: a line
        report(k, 1.0)
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines[1:]] == ["b: step 2/1000 (0%)", "b: step 4/1000 (0%)"]
    assert lines[1].endswith("1 min 1 s so far, about 8 h 27 min left")  # 998 steps at 61 s / 2 steps


def test_prepare_reports_to_stderr(tmp_path, capsys):
    prepare_base_policy(CFG, tmp_path, "tiny base")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"tiny base: building: {CFG.steps} optimizer steps in {tmp_path}")
    assert err[-1].startswith(f"tiny base: step {CFG.steps}/{CFG.steps} (100%)")
    prepare_base_policy(CFG, tmp_path, "tiny base")  # stored: silent
    assert capsys.readouterr().err == ""


def test_a_shipped_base_is_read_after_the_cache(tmp_path, monkeypatch):
    from safetensors import safe_open

    shipped = tmp_path / "shipped"
    out = ship_base_policy(CFG, tmp_path / "build", directory=shipped)
    assert out == shipped / f"toolshop-base-{CFG.key()}.safetensors"
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["config"])["steps"] == CFG.steps and float(meta["demo_loss"]) > 0
    monkeypatch.setattr(toolshop_base, "SHIPPED_DIR", shipped)
    empty = tmp_path / "empty"
    assert base_file(CFG, empty) == out
    calls = []
    model = base_policy(CFG, cache_dir=empty, progress=lambda k, loss: calls.append(k))
    assert calls == [] and not empty.exists()  # loaded, not trained; nothing written
    assert _same(model, base_policy(CFG, cache_dir=tmp_path / "build"))
    prepare_base_policy(CFG, empty, "tiny base", progress=False)
    assert not empty.exists()
    # the cache comes first: a build there (here: another seed's weights under this key) is what loads
    cached = base_policy(CFG, cache_dir=tmp_path / "own", refresh=True)
    assert base_file(CFG, tmp_path / "own") == tmp_path / "own" / out.name
    assert _same(base_policy(CFG, cache_dir=tmp_path / "own"), cached)


def test_a_quick_run_says_its_base_policies_are_not_the_labs():
    from creditlab.labs._toolshop import base_note
    from creditlab.labs.granularity import GranularityConfig, _quick_note
    from creditlab.labs.toolshop import QUICK_BASE

    lab = {"base policy": BaseConfig()}
    assert base_note(lab, lab, "what it shows.") == ""
    assert base_note({"base policy": QUICK_BASE}, lab, "what it shows.") == (
        " This run's base policy is not the lab's (a quick build: fewer, smaller steps; its settings are in the "
        "configuration at the end): what it shows.")
    assert _quick_note(GranularityConfig()) == ""
    note = _quick_note(GranularityConfig.quick())
    assert ("base policy, three-type base policy, warm-started base policy and budget base policy are not the "
            "lab's") in note
    only_warm = GranularityConfig.quick().with_options(experiments=("warm",))
    assert "This run's base policy and warm-started base policy are" in _quick_note(only_warm)  # warm starts from it
