"""The command line's value types: what argparse accepts for a count, a deadline, a directory."""

from __future__ import annotations

import argparse

from sglang_dsa_fix.server_status import MAX_TIMEOUT

# Integer options' range: sglang's token counts are int32 (req_to_token's dtype).
MAX_INT_OPTION = 2**31 - 1


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # also: more digits than int() converts
        value = 0
    if not 0 < value <= MAX_INT_OPTION:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {MAX_INT_OPTION}, got {text[:40]}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds above 0 and at most {MAX_TIMEOUT:g}, got {text[:40]}"
        )
    return value


_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def human_int(text: str) -> int:
    """A positive int as sglang's flags take it (0.5.23 utils/common.py:3394): ``163840``,
    ``160Ki`` (IEC, integers only), ``25.6k`` (SI); suffixes are case-sensitive."""
    import re
    from decimal import Decimal

    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", text.strip()[:64])
    if (
        len(text.strip()) > 64
        or not match
        or (match[2] in _IEC and "." in match[1])
        or (match[2] is None and "." in match[1])
    ):
        raise argparse.ArgumentTypeError(
            f"invalid integer {text[:40]!r}: a plain integer, SI (25.6k, 1M) or IEC (160Ki) suffixes"
        )
    number, suffix = match.groups()
    value = int(Decimal(number) * (_SI.get(suffix) or _IEC.get(suffix) or 1))
    if not 0 < value <= MAX_INT_OPTION:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {MAX_INT_OPTION}, got {text}")
    return value


def directory(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text
