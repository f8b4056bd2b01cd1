"""``python -m sglang_dsa_fix``: the same CLI as the ``sglang-dsa-fix`` command.

``-m`` puts the working directory first on sys.path: a ``dataclasses.py`` there would be imported
in place of the standard library's (as root, too). It leaves sys.path before this package imports
anything. runpy's own imports (``contextlib``, ``types`` ...) ran before this file, from there
too: the console script, or ``python -I -m sglang_dsa_fix``, does not look there at all.
"""

import os
import sys

if not getattr(sys.flags, "safe_path", False) and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from sglang_dsa_fix.cli import main  # noqa: E402 (after the working directory left sys.path)

sys.exit(main())
