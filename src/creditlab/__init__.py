"""creditlab: find and fix the silent failures of agentic RL training on LLMs.

Three places where training goes wrong without an error message, and the minimal correction for
each: the reward definition (FORK), the numerical execution (InterQ-RL) and the credit assignment
(credit geometries, PRM mixing, on-policy self-distillation). See ``docs/``; ``docs/design.md`` has the
layers and the formulas.
"""

from creditlab.errors import ConfigError, CreditlabError, InputError

#: The one version source: setuptools reads it for the package metadata (pyproject.toml).
__version__ = "0.2.0"

__all__ = ["ConfigError", "CreditlabError", "InputError", "__version__"]
