"""The environment for a test's child Python process: the package under
test on its path. CI runs the suite against the installed wheel, from
outside the tree, where the tree's ``python/`` has no built extension; a
child that put ``python/`` on its path, or that inherited only the
caller's environment, would import the wrong package or none. The parent's
``sys.path`` names the package the suite is testing, whichever it is."""

from __future__ import annotations

import os
import sys


def package_env() -> dict[str, str]:
    """``os.environ`` with PYTHONPATH set to this process's ``sys.path``."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
