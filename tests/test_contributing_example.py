"""The example lab of docs/contributing.md runs as written (so the guide cannot rot)."""

import re
import sys
import types
from pathlib import Path

from creditlab.lab.protocol import run_lab
from creditlab.labs import get_lab, register_lab, unregister_lab

DOC = Path(__file__).resolve().parents[1] / "docs" / "contributing.md"


def test_the_coin_lab_of_the_guide_runs_and_resumes(tmp_path):
    block = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[0]
    module = types.ModuleType("creditlab_guide_coin")
    sys.modules[module.__name__] = module  # the cell function must be importable by name (pickling)
    try:
        exec(compile(block, str(DOC), "exec"), module.__dict__)
        lab = register_lab(module.LAB)
        assert get_lab("coin") is lab
        res = run_lab(lab, lab.config_type.quick(), tmp_path, progress=False)
        assert set(res.tables) == {"heads", "heads_diff"}
        report = (tmp_path / "report.md").read_text()
        assert "biased - fair over 3 paired seeds" in report
        assert run_lab(lab, lab.config_type.quick(), tmp_path, progress=False).computed == 0
    finally:
        if "LAB" in module.__dict__:
            unregister_lab("coin")
        sys.modules.pop(module.__name__, None)
