"""Collection rules for the whole run (``tests/`` and the doctests of ``src/``)."""

import importlib.util
import sys

# The SkyRL integration imports SkyRL, whose training modules need Python >= 3.12; where SkyRL is
# missing or the Python is older, its module cannot be imported for its doctests. Its tests
# (tests/integrations/test_skyrl.py) load SkyRL's registries themselves and skip with the reason.
collect_ignore = []
if importlib.util.find_spec("skyrl") is None or sys.version_info < (3, 12):
    collect_ignore.append("src/creditlab/integrations/skyrl.py")
# The OpenRLHF integration imports OpenRLHF, which the suite's environment does not install (its GPU
# dependencies do not fit beside the other trainers); its tests install it themselves
# (tests/integrations/openrlhf_loader.py) and run the module's doctests (tests/integrations/test_openrlhf.py).
if importlib.util.find_spec("openrlhf") is None:
    collect_ignore.append("src/creditlab/integrations/openrlhf.py")
