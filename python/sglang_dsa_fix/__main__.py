"""``python -m sglang_dsa_fix``: the same CLI as the ``sglang-dsa-fix`` command."""

import sys

from sglang_dsa_fix.cli import main

sys.exit(main())
