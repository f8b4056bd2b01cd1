"""What a tree's files say, per bug: judged from one read of the tree (``snapshot``), never written.

``states`` returns one ``BugState`` per bug (``verdicts.Verdict`` and the site), judging each
file by its form (``sites``) and by this tool's backup beside it (``<file>.sglang-dsa-fix.orig``):
a file that carries the change but no longer matches its backup was hand-edited and is refused.
``read_tree`` is the tree step of the verdict flow (``status.collect``); ``check`` the same
states for ``check`` and the plugin. The writes (apply / revert) are in ``source_patch``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from sglang_dsa_fix import members, snapshot
from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.release import Form
from sglang_dsa_fix.sites import Site
from sglang_dsa_fix.snapshot import FileView, TreeFiles
from sglang_dsa_fix.tree import SglangTree
from sglang_dsa_fix.verdicts import Bug, Verdict


@dataclass
class BugState:
    bug: Bug
    verdict: Verdict
    site: Optional[Site] = None
    original: Optional[bytes] = None  # pristine bytes of the site's file, when known
    stale_bytecode: list = field(default_factory=list)  # .pyc files Python loads instead
    detail: str = ""

    def to_dict(self) -> dict:
        out = {"bug": self.bug.value, "tree_state": self.verdict.value, "detail": self.detail}
        if self.site is not None:
            out.update(file=str(self.site.path), line=self.site.lineno, found=self.site.found)
        if self.stale_bytecode:
            out["stale_bytecode"] = [str(p) for p in self.stale_bytecode]
        return out


def stale_bytecode(headers: tuple, source: bytes) -> list:
    """``.pyc`` files (of ``snapshot.FileView.bytecode``) Python would load without checking them
    against ``source``.

    Only unchecked hash-based pycs (``compileall --invalidation-mode unchecked-hash``, PEP 552
    flags == 0b01) are loaded as they are; timestamp and checked-hash pycs are revalidated.
    """
    expected = importlib.util.source_hash(source)
    return [
        pyc
        for pyc, header in headers
        if int.from_bytes(header[4:8], "little") == 0b01 and header[8:16] != expected
    ]


def _backup(view: FileView) -> Optional[bytes]:
    """The backup as read; a backup that could not be read is the error it always was."""
    if view.backup_error is not None:
        exc = view.backup_error
        raise ToolError(f"{exc.filename or view.path}: cannot read ({exc.strerror})")
    return view.backup


def _stale_backup_advice(view: FileView) -> str:
    return (
        f"if sglang was upgraded or reinstalled since, that backup is stale: `rm "
        f"{view.backup_path}` and run `sglang-dsa-fix check` again"
    )


def _state(files: TreeFiles, found: members.Found, member: members.Member) -> BugState:
    bug = member.bug
    site = found.sites[bug]
    if site is None:
        unjudged = member.unjudged(found)
        if unjudged:
            return BugState(bug, Verdict.NOT_COVERED, detail=unjudged)
        return BugState(bug, Verdict.NOT_APPLICABLE, detail=member.absent)
    view = next(view for view in files.views.values() if view.path == site.path)
    if site.patched_here and not site.marked and _backup(view) is None:
        # Nothing tells this tool's change from upstream's same spelling (no comment of its
        # own, no backup beside it): sglang's own code, judged as such.
        site = site.as_upstream()
    if site.patched_here:
        original = _backup(view)
        if original is not None:
            original_site = found.originals[bug]
            matches = original_site is not None and (
                site.legacy or original_site.patched_bytes() == site.data
            )
            if not matches or original_site.patched_here:
                raise ToolError(
                    f"{site.path}: changed since sglang-dsa-fix applied it ({view.backup_path.name} no "
                    f"longer matches): not touching it; {_stale_backup_advice(view)}"
                )
        stale = stale_bytecode(view.bytecode, site.data)
        verdict = Verdict.STALE_BYTECODE if stale else Verdict.FIXED_IN_TREE
        detail = (
            "" if original is not None or not files.use_backups else "no backup (patched by `git apply`?)"
        )
        if site.legacy:
            detail = member.legacy
        return BugState(bug, verdict, site, original, stale, detail)
    if site.fixed_upstream:
        return BugState(bug, Verdict.FIXED_UPSTREAM, site, detail=member.holds)
    if site.unknown:
        return BugState(bug, Verdict.NOT_COVERED, site, detail=site.unknown)
    if _backup(view) not in (None, site.data):
        # (A backup equal to the file is what an interrupted apply or revert leaves: apply
        # rewrites it, revert removes it.)
        raise ToolError(
            f"{site.path}: {view.backup_path.name} exists but the file neither carries the fix nor "
            f"matches it: changed since sglang-dsa-fix applied it; not touching it; {_stale_backup_advice(view)}"
        )
    detail = f"{member.affected_what} affected {site.affected_when}" if site.affected_when else ""
    return BugState(bug, Verdict.AFFECTED, site, site.data, detail=detail)


def judged_with_its_backup(files: TreeFiles, state: BugState) -> BugState:
    """A ``fixed_upstream`` judged without backups (the plugin, ``use_backups=False``), judged
    again where the backup beside the file says ``apply`` wrote it: a change with no comment of
    its own (the graph-table relatives') reads as upstream's same spelling, but a backup, affected,
    that ``apply`` turns into these very bytes makes it ``fixed_in_tree``, or ``stale_bytecode``
    where Python loads bytecode of other source, as ``check`` says. Any doubt (no backup,
    unreadable, another form) keeps ``state``. The plugin's decisions stay its own: only a
    stale bytecode case is hooked, as every stale one is."""
    if state.verdict is not Verdict.FIXED_UPSTREAM or state.site is None or files.use_backups:
        return state
    try:
        backup = snapshot.backup_of(state.site.path)
    except OSError:
        return state
    site = None if backup is None else members.of(state.bug).locate(files)  # as located: not as upstream's
    original = None if site is None else members.site_in(site, files, backup)
    if original is None or original.patched_here or original.patched_bytes() != site.data:
        return state
    view = next(view for view in files.views.values() if view.path == site.path)
    stale = stale_bytecode(view.bytecode, site.data)
    return BugState(
        state.bug, Verdict.STALE_BYTECODE if stale else Verdict.FIXED_IN_TREE, site, backup, stale
    )


def states(files: TreeFiles) -> list:
    """One BugState per bug. ToolError when a file is not recognised or was hand-edited."""
    judged = each_state(files)
    unjudged = next((s for s in judged if isinstance(s, Unjudged)), None)
    if unjudged is not None:
        raise unjudged.error
    return judged


@dataclass
class Unjudged:
    """A bug whose file this tool will not touch (``each_state``): the file, and why."""

    path: Path
    error: ToolError


def each_state(files: TreeFiles) -> list:
    """``states``, with an ``Unjudged`` in the place of a bug whose file was hand-edited (or whose
    backup cannot be read) instead of raising: ``revert`` restores every file it can and names
    the others. A file that is not recognised at all still raises."""
    found = members.find(files)
    judged = []
    for member in members.registry():
        try:
            judged.append(_state(files, found, member))
        except ToolError as exc:
            judged.append(Unjudged(found.sites[member.bug].path, exc))
    return judged


@dataclass
class TreeReport:
    """What one tree's files say, read once: the files, per bug a ``BugState``, and the release's
    form (its label's, unless the files' shape contradicts it; then the files win and
    ``version_note`` says so)."""

    files: TreeFiles
    states: list
    form: Form  # the release's form (``release.Form``): what the pristine arithmetic follows
    version_note: str = ""

    @property
    def tree(self) -> SglangTree:
        return self.files.tree


def read_tree(tree: SglangTree) -> TreeReport:
    """The tree step of the verdict flow (``status.collect``): one read under the shared lock,
    then the states and the release the files say, from that read alone."""
    files = snapshot.read(tree)
    found = members.find(files)
    states = [_state(files, found, member) for member in members.registry()]
    return TreeReport(files, states, found.form, found.form_note)


def check(tree: SglangTree, wait: bool = True, use_backups: bool = True) -> list:
    """The states of a fresh read (``snapshot.read``: under the shared lock unless ``wait`` is
    False; ``use_backups=False`` for the plugin, which judges each file by itself)."""
    return states(snapshot.read(tree, use_backups, wait))
