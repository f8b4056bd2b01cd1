"""FA3's in-tree change (where the widths sit), now in its member's unit (``members/fa3/sites.py``); this name stays for a while so
that callers of the old module (tests, scripts) keep working: it is that module."""

import sys

from sglang_dsa_fix.members.fa3 import sites as _moved

sys.modules[__name__] = _moved
