"""The family: one ``Member`` per bug, each a unit of its own, and the contract they all keep.

A member holds what makes it that bug: its texts, where its in-tree change goes (``locate``,
over ``sites`` / ``fa3_sites`` / ``graph_tables``), its rule at a configuration (``rule``), the
plugin's hook (``hook``) and the family watch's counters that see it (``watch``). The shared
machinery (``classify``, ``bugs``, ``plugin.decide``) asks the registry and never branches on a
member; ``test/test_members.py`` holds every member to the contract on every release it reads.

Adding a member: its unit here (a module defining ``MEMBERS``, and ``WATCHES`` where the family
watch counts it), a line in ``UNITS`` and its ``verdicts.Bug`` token.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from sglang_dsa_fix import release, width
from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.verdicts import Bug

# One line per unit, in the order the tool reports its members.
UNITS = ("page_table", "row_overflow", "fa3", "graph_table")
# Units the family watch counts without a member (no rule yet): they define only ``WATCHES``.
WATCH_ONLY_UNITS = ("watch_only",)

# A runtime fix that found its buffer wide enough already (/server_info's detail).
ALREADY_WIDE = "already as wide as req_to_token"


@dataclass(frozen=True)
class HookPlan:
    """What the plugin registers for an affected member: an AFTER hook ``body(info, result,
    *args, **kwargs) -> (value, log line or None)`` on ``target`` (``info``: the member's entry
    in /server_info), or REPLACE hooks of the methods ``replace`` (an ``EditSite``) edits."""

    target: str
    body: Optional[Callable] = None
    replace: Optional[object] = None


@dataclass(frozen=True)
class WatchKind:
    """One kind of check the family watch (``watch.py``) runs, declared by the unit it watches for."""

    kind: str  # the counters' key (/server_info's watch report, /metrics)
    counters: tuple  # (sites counted, columns past the end or None), as ``watch.report()`` names them
    targets: tuple  # ``release.WatchTarget``s in preference order: the first in range that resolves
    replay_check: Optional[Callable] = None  # a CUDA-graph replay, on the host: (site, arguments)
    # A row write / read, on the device: batch_size's position (a tensor of one entry per row
    # there, e.g. seq_lens: its length; row_check.check clamps it to the start and end tensors').
    batch_size_at: Optional[int] = None
    # A row read of the same N columns from start in every row (no end tensor): N is the product
    # of the arguments at these positions.
    span_at: tuple = ()
    # A row check's: sglang's parameter names in order, up to the last one read (for keyword calls;
    # test_watch.py checks them against the installed function's signature).
    parameters: tuple = ()


@dataclass(frozen=True)
class Member:
    bug: Bug
    title: str  # "bug #N <what> (<effect>)": check / status / the plugin's log
    column: str  # its column in ``status --url``'s table (bug #3's relatives: their token, shorter)
    absent: str  # not_applicable: what a tree without the member lacks
    holds: str  # fixed_upstream: what sglang's own code holds
    affected_what: str  # the subject of ``Site.affected_when`` ("these graph page tables are")
    legacy: str  # an older form of this tool's change: what to do
    locate: Callable  # (files, data=None) -> Site / EditSite, or None where the tree has none
    rule: Callable  # (verdict, found, form, inputs, resolved) -> the member at a configuration
    hook: Callable  # (files, site, sglang tree) -> HookPlan
    watch: tuple  # the family watch's kinds (``WatchKind.kind``) counting this member
    unwatched: str = ""  # where ``watch`` is (): why no counter sees it
    unjudged: Callable = lambda found: ""  # no site, yet not absent: why (then ``cannot_tell``)
    releases: str = ""  # the sglang releases it is in ("explain", docs/members/<token>.md)
    # What it looks like in sglang's log: (regular expression, what that line means), for `explain`.
    symptoms: tuple = ()


_REGISTRY: list = []
_WATCHES: list = []


def registry() -> tuple:
    """Every member, in report order (the units, imported once)."""
    if not _REGISTRY:  # built whole, then set: a re-entered first call never adds twice
        found = [member for unit in UNITS for member in importlib.import_module(f"{__name__}.{unit}").MEMBERS]
        _REGISTRY[:] = found
    return tuple(_REGISTRY)


def watch_kinds() -> tuple:
    """Every kind the family watch counts: each unit's ``WATCHES``, the row checks first (the
    watch hooks and reports in this order; ``first_violation`` is the first site with a count)."""
    if not _WATCHES:
        units = (importlib.import_module(f"{__name__}.{unit}") for unit in (*UNITS, *WATCH_ONLY_UNITS))
        found = [kind for unit in units for kind in getattr(unit, "WATCHES", ())]
        _WATCHES[:] = sorted(found, key=lambda kind: kind.batch_size_at is None)
    return tuple(_WATCHES)


def of(bug: Bug) -> Member:
    return next(member for member in registry() if member.bug is bug)


# ----------------------------------------------------------------------------------------------
# The flow's steps that ask every member.


@dataclass(frozen=True)
class Found:
    """What one tree's files hold, for ``classify``: per bug its site (None: none here) and,
    where the file carries this tool's change and its backup was read, the site in the backup
    (None: the backup is not a form this tool made); the release's form."""

    sites: dict
    originals: dict
    spec_v2: bool  # the spec-v2 decode reservation is there at all (``has_spec_v2_reservation``)
    form: release.Form
    form_note: str


def site_in(site, files, data: bytes):
    """The same member's site in other bytes of the same file (a backup), or None."""
    try:
        return of(site.bug).locate(files, data)
    except ToolError:
        return None


def find(files) -> Found:
    """Every member's site and the release's form, from the files read. ToolError if a file is
    not a form this tool recognises."""
    from sglang_dsa_fix import sites

    located = {member.bug: member.locate(files) for member in registry()}
    views = {view.path: view for view in files.views.values()}
    originals = {
        bug: site_in(site, files, views[site.path].backup)
        for bug, site in located.items()
        if site is not None and site.patched_here and views[site.path].backup is not None
    }
    return Found(located, originals, sites.has_spec_v2_reservation(files), *sites.release_form(files))


def at_configuration(bug: Bug, verdict, found: str, form: release.Form, resolved: dict) -> dict:
    """One member at a resolved (or static) configuration: its widths, whether it is reached
    (``reachable``: True / False / None, or ``cannot_tell``), and the same with the fix."""
    if resolved.get("basis") == width.UNRESOLVED:
        return {"reachable": None, "cannot_tell": "sglang did not resolve the launch arguments"}
    return of(bug).rule(verdict, found, form, width.configuration_inputs(resolved), resolved)
