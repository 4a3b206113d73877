"""The ``creditlab`` command (typer): ``lab <name>``, ``fork score``, ``diagnose``.

The top layer: one ``creditlab lab <name>`` sub-command per name of ``creditlab.labs.lab_names``,
built from the lab object (its config and its own ``LabOption`` flags). An edge of the package: it reads the
environment (e.g. ``CREDITLAB_CACHE``) and names CLI flags in errors.
"""

from creditlab.cli._process import use_huge_pages

use_huge_pages()  # before the commands import PyTorch (cli/_process.py)
