"""The plugin's names and its kill switch: what sglang loads, and what turns the fixes off.

Read by the plugin in every server process and by ``status`` / ``check`` (which say how the
server's environment would take a value). Pure: no torch, no sglang.
"""

from __future__ import annotations

import os

# The package's own name first; the old name stays for existing SGLANG_PLUGINS allow-lists.
# sglang calls register() once per entry point name: it is idempotent.
ENTRY_POINT_NAMES = ("sglang_dsa_fix", "dsa_page_table_width")
KILL_SWITCH = "SGLANG_DSA_FIX"
KILL_VALUES = ("0", "false", "no", "off")
ENABLE_VALUES = ("1", "true", "yes", "on", "")


def kill_switch_value() -> str:
    return os.environ.get(KILL_SWITCH, "")


def enabled(value: str | None = None) -> bool:
    value = kill_switch_value() if value is None else value
    return value.strip().lower() not in KILL_VALUES


def known_switch_value(value: str) -> bool:
    return value.strip().lower() in KILL_VALUES + ENABLE_VALUES


def kill_switch_text(value: str) -> str:
    """How a kill-switch value is taken, as the state and ``status`` say it."""
    if known_switch_value(value):
        return f"{KILL_SWITCH}={value!r}: {'enabled' if enabled(value) else 'disabled'}"
    return (
        f"{KILL_SWITCH}={value!r}: enabled (not a known value: 0 / false / no / off disable, "
        "1 / true / yes / on or unset enable)"
    )
