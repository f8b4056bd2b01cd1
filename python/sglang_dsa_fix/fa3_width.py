"""FA3's width rule and runtime fix, now in its member's unit (``members/fa3/tables.py``); this name stays for a while so
that callers of the old module (tests, scripts) keep working: it is that module."""

import sys

from sglang_dsa_fix.members.fa3 import tables as _moved

sys.modules[__name__] = _moved
