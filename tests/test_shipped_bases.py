"""The base policies that ship with the package (creditlab/train/bases/) match their configs.

A shipped file is a build of its config (``ship_base_policy``; the mismatch lab's rebuild command is in
``creditlab.labs.mismatch.config._base_config``): its name is the config's key, its metadata holds the config
and the imitation loss of the weights on the config's first 64 demonstrations, and the weights load
into the config's model and give that loss again. A file trained on other demonstrations, of another
architecture, or renamed, fails here.
"""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from creditlab.labs.mismatch import MismatchConfig
from creditlab.models.tiny_lm import TinyLM
from creditlab.train.toolshop_base import SHIPPED_DIR, BaseConfig, base_file, base_policy, demo_loss

SHIPPED = sorted(SHIPPED_DIR.glob("toolshop-base-*.safetensors"))


def _meta(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()


def _config(meta: dict[str, str]) -> BaseConfig:
    d = json.loads(meta["config"])
    return BaseConfig(**{**d, "chain_lengths": tuple(d["chain_lengths"])})


def test_the_mismatch_lab_base_ships_so_no_run_builds_it(tmp_path):
    cfg = MismatchConfig().base
    assert MismatchConfig.quick().base == cfg
    path = base_file(cfg, tmp_path)  # an empty cache: the shipped file
    assert path is not None and path.parent == SHIPPED_DIR
    assert json.loads(_meta(path)["config"]) == json.loads(json.dumps(asdict(cfg)))
    calls = []
    base_policy(cfg, cache_dir=tmp_path, progress=lambda k, loss: calls.append(k))
    assert calls == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_a_shipped_base_is_a_build_of_its_config(path):
    meta = _meta(path)
    cfg = _config(meta)
    assert path.name == f"toolshop-base-{cfg.key()}.safetensors"
    assert path.stat().st_size < 2 * 2**20
    model = base_policy(cfg, cache_dir=path.parent)  # strict load: every weight, of the config's shapes
    loss = demo_loss(model, cfg)
    assert loss == pytest.approx(float(meta["demo_loss"]), rel=1e-4)
    untrained = TinyLM(cfg.model_config(), generator=torch.Generator().manual_seed(cfg.seed)).eval()
    assert loss < 0.6 * demo_loss(untrained, cfg)


def test_the_shipped_files_are_package_data():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()  # no tomllib on Python 3.10
    section = text.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert '"train/bases/*.safetensors"' in section
    assert SHIPPED and all(p.parent == SHIPPED_DIR for p in SHIPPED)
