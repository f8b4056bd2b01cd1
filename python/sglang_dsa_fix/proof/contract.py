"""The contract every family member keeps (``members``), checked on one sglang tree.

``violations(member, package)`` returns what the member fails, in words (empty: it keeps the
contract), driving the real flow on a disposable copy of the release's files (``package``: its
``sglang`` directory, never written):

- identity and texts: a title ``bug #N ... (crash | silent corruption)``, the not-applicable and
  fixed-upstream texts; its state's token and text are the vocabulary's (``verdicts``);
- the watch: each of its kinds is a counter of the family watch, or it says why none sees it;
- the tree: with no site, ``not_applicable`` (its ``absent`` text) or ``cannot_tell`` (its
  ``unjudged`` text); affected, its change alone written as ``apply`` writes it (the file and
  its backup) reads ``fixed_in_tree`` (in ``check`` and in the plugin, which reads no backups
  for its decisions), applying it again changes nothing, and ``revert``
  restores the file byte for byte; the same change as upstream would spell it (no comment of
  this tool's, no backup) reads ``fixed_upstream`` and ``apply`` leaves it; with the changed
  definition defined again after it as sglang wrote it, the member reads ``affected`` and
  ``apply`` changes that last definition (the one Python keeps) only;
- the plugin: for an affected, hookable site, a hook on an sglang target (an AFTER body or the
  methods it replaces), and ``plugin.decide`` plans the member;
- the rule: at every point of ``GRID`` (algorithms, topk, page sizes, backends) an answer:
  reached or not with the reason, or ``cannot_tell`` with the reason; never an unexplained None.

``registry_violations()`` holds the registry itself to one member per ``verdicts.Bug`` and every
watch kind to a member (or to the kinds the watch counts beyond the rules).
"""

from __future__ import annotations

import ast
import importlib
import itertools
import shutil
import tempfile
from pathlib import Path

from sglang_dsa_fix import classify, members, pysource, release, snapshot, source_patch, tree, watch, width
from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.verdicts import Bug, State, Verdict

ALGORITHMS = ("EAGLE", "EAGLE3", "NGRAM", "DFLASH", "STANDALONE", "A_FUTURE_ALGORITHM", None)
BACKENDS = ("fa3", "triton", "dsa", "trtllm_mha", "trtllm_mla", "flashmla", "flashinfer")
GRID = tuple(
    itertools.product(ALGORITHMS, (1, 4), (1, 64), BACKENDS, (False, True))
)  # (algorithm, topk, page, backend, cuda graphs disabled)
TITLE_ENDS = ("(crash)", "(silent corruption)")


def resolved_at(algorithm, topk: int, page: int, backend: str, graphs_off: bool) -> dict:
    """A configuration as sglang resolves one (``resolve``'s result), context 4096, D 4."""
    D = 4 if algorithm else 0
    return {
        "basis": "sglang",
        "configuration": {
            "context_length": 4096,
            "speculative_algorithm": algorithm,
            "speculative_num_draft_tokens": D or None,
            "speculative_eagle_topk": topk if algorithm else None,
            "page_size": page,
            "attention_backend": backend,
            "disable_cuda_graph": graphs_off,
            "model_attention_backend": backend,
        },
        "widths": {"row_extra": D + 4, "decode_reserve": 2 * D, "alloc_page_size": page},
    }


def _copy(package: Path, into: Path) -> tree.SglangTree:
    for relative in release.FILES_READ:
        if (package / relative).exists():
            (into / "python/sglang" / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(package / relative, into / "python/sglang" / relative)
    return tree.find_tree(str(into))


def _state(sglang, bug: Bug):
    return next(state for state in classify.check(sglang) if state.bug is bug)


def _identity(member) -> list:
    out = []
    if not (member.title.startswith("bug #") and member.title.endswith(TITLE_ENDS)):
        out.append(f"title {member.title!r} is not 'bug #N ... {' | '.join(TITLE_ENDS)}'")
    if not member.absent or not member.holds:
        out.append("no not-applicable or fixed-upstream text")
    unknown = [kind for kind in member.watch if kind not in watch.kinds()]
    if unknown:
        out.append(f"watch kinds {unknown} are no counters of the family watch")
    if not member.watch and not member.unwatched:
        out.append("no watch counter sees it, and it does not say why")
    return out


def _rule(member, verdict: Verdict, found: str, form) -> list:
    out = []
    for point in GRID:
        resolved = resolved_at(*point)
        at = member.rule(verdict, found, form, width.configuration_inputs(resolved), resolved)
        reachable = at.get("reachable")
        if reachable is None and not at.get("cannot_tell"):
            out.append(f"{verdict.value} at {point}: neither reached, nor not, nor cannot_tell")
        numbers = any(isinstance(value, int) and not isinstance(value, bool) for value in at.values())
        if reachable is False and not at.get("why_not") and not numbers:
            out.append(f"{verdict.value} at {point}: not reached, with no reason or numbers")
        if len(out) >= 3:
            break
    return out


def _tree(member, sglang) -> list:
    from sglang_dsa_fix import plugin

    state = _state(sglang, member.bug)
    if state.site is None:
        expected = {Verdict.NOT_APPLICABLE: member.absent, Verdict.NOT_COVERED: None}
        if state.verdict not in expected or (expected[state.verdict] not in (None, state.detail)):
            return [f"no site: {state.verdict.value} ({state.detail!r}), not {member.absent!r}"]
        return []
    out = _rule(member, state.verdict, state.site.found, classify.read_tree(sglang).form)
    if state.verdict is not Verdict.AFFECTED:
        return out
    site, files = state.site, snapshot.read(sglang)
    if site.hookable:
        planned = member.hook(files, site, sglang)
        if not planned.target.startswith("sglang.") or (planned.body is None) == (planned.replace is None):
            out.append(f"plugin hook {planned} is not one sglang target with a body or a replacement")
        if member.bug not in [plan.bug for plan in plugin.decide(sglang)]:
            out.append("plugin.decide does not plan it")
    patched = site.patched_bytes()
    again = member.locate(files, patched)
    if again is None or not again.patched_here:
        out.append("its own change is not recognised as applied")
    # The change alone, as apply writes it: the file and its backup beside it.
    site.path.with_name(site.path.name + tree.BACKUP_SUFFIX).write_bytes(site.data)
    site.path.write_bytes(patched)
    after = _state(sglang, member.bug)
    if after.verdict is not Verdict.FIXED_IN_TREE:
        out.append(f"after its change: {after.verdict.value}, not fixed_in_tree")
    reported = next(plan.state for plan in plugin.decide(sglang) if plan.bug is member.bug)
    if reported is not State.FIXED_IN_TREE:  # the plugin reads no backups: the same answer
        out.append(f"after its change the plugin reports {reported.token}, not fixed_in_tree")
    source_patch.apply(sglang)  # the other members' changes: this file must stay as it is
    if site.path.read_bytes() != patched:
        out.append("apply changes its file again")
    source_patch.revert(sglang)
    if site.path.read_bytes() != site.data:
        out.append("revert does not restore its file byte for byte")
        return out
    return out + _upstream_spelling(member, sglang, site) + _kept_definition(member, sglang, site)


def _written(sglang, site, data: bytes, member) -> tuple:
    """(its state with ``data`` in its file, no backup; the file after ``apply``, or the error
    apply / revert stopped with), the tree restored after."""
    site.path.write_bytes(data)
    try:
        state = _state(sglang, member.bug)
        source_patch.apply(sglang)
        after = site.path.read_bytes()
        source_patch.revert(sglang)  # (the other members' changes)
    except ToolError as exc:
        after = f"apply / revert refused: {exc}"
    finally:
        site.path.write_bytes(site.data)
        site.path.with_name(site.path.name + tree.BACKUP_SUFFIX).unlink(missing_ok=True)
    return state, after


def _upstream_spelling(member, sglang, site) -> list:
    """Its change as upstream would spell it (without this tool's comment), no backup beside
    it: sglang's own fix, ``fixed_upstream``, which ``apply`` leaves as it is."""
    fixed = site.unmarked_bytes()
    state, after = _written(sglang, site, fixed, member)
    out = []
    if state.verdict is not Verdict.FIXED_UPSTREAM:
        out.append(
            f"its change in upstream's spelling (no comment, no backup): {state.verdict.value}, not fixed_upstream"
        )
    if after != fixed:
        out.append(after if isinstance(after, str) else "apply changes upstream's own fix")
    return out


def _kept_definition(member, sglang, site) -> list:
    """The definition holding its site, changed, then defined again as sglang wrote it: Python
    keeps the second, so the member is ``affected`` and ``apply`` changes the second only."""
    module = ast.parse(site.data)
    top = next(
        (n for n in module.body if hasattr(n, "name") and n.lineno <= site.lineno <= n.end_lineno), None
    )
    if top is None:
        return []
    lines = site.data.splitlines(keepends=True)
    first = pysource.first_line(top)
    patched = site.patched_bytes()
    data = patched + b"\n\n" + b"".join(lines[first - 1 : top.end_lineno])
    state, after = _written(sglang, site, data, member)
    out = []
    if state.verdict is not Verdict.AFFECTED:
        out.append(
            f"a pristine {top.name} defined after the changed one: {state.verdict.value}, not affected"
        )
    if isinstance(after, str):
        out.append(after)
    elif after[: len(patched)] != patched or after == data:
        out.append(f"with {top.name} defined twice, apply does not change the definition Python keeps")
    return out


def violations(member, package: Path) -> list:
    """What ``member`` fails on the tree whose ``sglang`` directory is ``package``."""
    out = _identity(member)
    with tempfile.TemporaryDirectory(prefix="sglang-dsa-fix-contract-") as tmp:
        sglang = _copy(Path(package), Path(tmp))
        out += _tree(member, sglang)
    return out


def watched_without_rule() -> set:
    """What the family watch counts beyond the members' rules ("members we have no rule for
    yet"): the kinds of the watch-only units."""
    units = (importlib.import_module(f"{members.__name__}.{unit}") for unit in members.WATCH_ONLY_UNITS)
    return {kind.kind for unit in units for kind in unit.WATCHES}


def watch_kind_violations() -> list:
    """Every kind the watch counts: one name, its own counters, a target, one way to check."""
    out, kinds = [], members.watch_kinds()
    names = [kind.kind for kind in kinds]
    counters = [name for kind in kinds for name in kind.counters if name]
    if len(set(names)) != len(names) or len(set(counters)) != len(counters):
        out.append(f"watch kinds or counter names repeat: {names} {counters}")
    for kind in kinds:
        if not kind.targets or any(target.kind != kind.kind for target in kind.targets):
            out.append(f"watch kind {kind.kind}: no target, or a target of another kind")
        if (kind.replay_check is None) == (kind.batch_size_at is None):
            out.append(f"watch kind {kind.kind}: not one of a replay check or a row check")
        if kind.span_at and kind.batch_size_at is None:
            out.append(f"watch kind {kind.kind}: a fixed span with no batch size (not a row check)")
        if kind.batch_size_at is not None and len(kind.parameters) <= max(
            3, kind.batch_size_at, *kind.span_at
        ):
            out.append(f"watch kind {kind.kind}: a row check without the names of the arguments it reads")
    return out


def registry_violations() -> list:
    registry = members.registry()
    out = []
    bugs = [member.bug for member in registry]
    if sorted(b.value for b in bugs) != sorted(b.value for b in Bug) or len(set(bugs)) != len(bugs):
        out.append(f"the registry's members {[b.value for b in bugs]} are not one per verdicts.Bug")
    owned = {kind for member in registry for kind in member.watch} | watched_without_rule()
    orphans = sorted(set(watch.kinds()) - owned)
    if orphans:
        out.append(f"watch kinds {orphans} belong to no member")
    return out + watch_kind_violations()
