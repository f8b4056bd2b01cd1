"""``sglang-dsa-fix explain "<a line from sglang's log>"``: which member a log message is.

Each member lists what it looks like in sglang's log (``Member.symptoms``); this matches a line
against all of them and returns, per member that matches, what the line means, the releases the
member is in and what to run. Pure: no tree, no sglang.
"""

from __future__ import annotations

import re

from sglang_dsa_fix import members

MAX_LINE = 64 << 10  # characters of the pasted text read (a log line; the rest is not searched)
NEXT = (
    "`sglang-dsa-fix check` says whether this sglang has it; `sglang-dsa-fix status -- <your launch "
    "line>` whether this deployment reaches it; `sglang-dsa-fix apply` (then restart the server) or the "
    "plugin fixes it"
)


def explain(text: str) -> dict:
    """The members whose symptoms match ``text``: their token, title, releases and what the
    matching line means; ``next`` what to run. ``matches`` is empty for a message none knows."""
    text = text[:MAX_LINE]
    matches = []
    for member in members.registry():
        for pattern, means in member.symptoms:
            found = re.search(pattern, text)
            if found:
                matches.append(
                    {
                        "member": member.bug.value,
                        "title": member.title,
                        "releases": member.releases,
                        "matched": found.group(0),
                        "means": means,
                    }
                )
                break
    return {"matches": matches, "next": NEXT if matches else None}


def known_messages() -> list:
    """Every symptom, once, as an operator reads it in a log (a number as ``N``)."""
    patterns = [pattern for member in members.registry() for pattern, _ in member.symptoms]
    shown = (p.replace(r"\((\d+)\)", "(N)").replace(r"(\d+)", "N").replace("\\", "") for p in patterns)
    return list(dict.fromkeys(shown))
