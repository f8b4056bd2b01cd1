"""Every per-release fact the tool uses, in one table per kind of fact, and the release's form.

sglang changes every two weeks; the tool judges a tree by what its files hold, never by a
release number typed by hand. What differs between releases lives here and nowhere else:

- where each release keeps the code the fixes change (``ROW_SIZING_FILES``, ...; the attention
  backends' ``LAYOUTS`` and ``GRAPH_TABLE_LAYOUTS`` in ``backend_layouts``):
  found by file layout, so patched forks and release candidates work too;
- the release's *form* (``FORMS``): how its decode path sizes and fills a ``req_to_token`` row,
  detected from the files (``detected_form``; ``sites.release_form`` reads them) and only
  where the files cannot tell, from the version label (``form_for``);
- the version range of a function the family watch hooks (``WatchTarget``; each member's unit lists its own).

The release ranges in comments are what the release matrix (scripts/release_matrix.py) runs.
Pure data and pure functions: no torch, no sglang, no file access.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from sglang_dsa_fix.backend_layouts import FA3_LAYOUT, GRAPH_TABLE_LAYOUTS, LAYOUTS

# ------------------------------------------------------------------------------ versions

_PEP440 = re.compile(
    r"v?(?P<release>\d+(?:\.\d+)*)(?:[-_.]?(?P<pre>a|b|c|rc|alpha|beta|pre|preview)[-_.]?\d*)?"
    r"(?:[-_.]?(?:post|rev|r)[-_.]?(?P<post>\d*))?(?:[-_.]?dev[-_.]?(?P<dev>\d*))?(?:\+[a-z0-9.]*)?$",
    re.IGNORECASE,
)


def parse_version(version: Optional[str]) -> Optional[tuple]:
    """A PEP 440 ordering key, or None: ``0.5.15.dev3`` < ``0.5.15rc1`` < ``0.5.15`` < ``0.5.15.post1``.

    Enough of PEP 440 for release numbers, pre/post/dev segments and local labels; no
    dependency on ``packaging`` (the tool installs nothing).
    """
    match = _PEP440.match((version or "").strip())
    if not match:
        return None
    release = tuple(int(x) for x in match["release"].split("."))
    release = (release + (0, 0, 0))[:3] if len(release) < 3 else release
    if match["pre"] is not None:
        phase = -1
    elif match["dev"] is not None and match["post"] is None:
        phase = -2  # 0.5.15.dev3 comes before any 0.5.15 pre-release
    else:
        phase = 1 if match["post"] is not None else 0
    return (*release, phase)


def at_least(version: Optional[str], release: tuple) -> bool:
    """``version >= release`` (a final release); unknown versions are not."""
    parsed = parse_version(version)
    return parsed is not None and parsed >= (*release, 0)


# ------------------------------------------------------------------------------ where the code lives

# The attention backends' layouts (bug #1, bug #3 and its relatives): ``backend_layouts``.

# Bug #2: ``get_req_to_token_extra_context_len`` sizes the request pool's row beyond
# context_len: mem_cache/allocation_sizing.py from 0.5.16 (:46), mem_cache/common.py in
# 0.5.13 - 0.5.15 (0.5.14 :251). Newest first. 0.5.11 - 0.5.12 size the row inline in
# model_executor/model_runner_kv_cache_mixin.py (0.5.12 :245-247) with the same spec-v2
# reservation in speculative/eagle_info_v2.py (0.5.9 - 0.5.10 also in the mixin, 0.5.9 :424):
# there the in-tree patch changes that block; nothing to hook, so the plugin cannot. 0.5.4 sizes
# it inline in model_runner.py and has no get_alloc_len_per_decode: bug #2 not covered there.
ROW_SIZING_FILES = ("srt/mem_cache/allocation_sizing.py", "srt/mem_cache/common.py")
ROW_SIZING_FUNCTION = "get_req_to_token_extra_context_len"
RESERVE_FUNCTION = "get_alloc_reserve_per_decode"
SPEC_V2_DECODE_FILE = "srt/speculative/eagle_info_v2.py"
INLINE_ROW_FILE = "srt/model_executor/model_runner_kv_cache_mixin.py"
INLINE_ROW_VARIABLE = "extra_max_context_len"
# Where 0.5.9 - 0.5.12 define A (0.5.12 managers/utils.py:213; the reservation is 2·A).
INLINE_ALLOC_FILE = "srt/managers/utils.py"
INLINE_ALLOC_FUNCTION = "get_alloc_len_per_decode"
# Launch paths that build a Scheduler without calling load_plugins(): the plugin never runs
# there (0.5.11 - 0.5.23 ray/scheduler_actor.py:104, 0.5.23 :113). Found by reading the file.
PLUGINLESS_LAUNCHERS = {"srt/ray/scheduler_actor.py": "RayEngine (sglang.srt.ray)"}

VERSION_FILES = ("_version.py", "version.py")
PLUGIN_API_FILE = "srt/plugins/hook_registry.py"
# Every file under ``sglang/`` the tool reads: enough to copy for a disposable test tree.
# The files a fix may change: beside each, ``snapshot.read`` also reads this tool's backup and
# Python's bytecode headers.
FILES_CHANGED = (
    *(layout.relative_path for layout in LAYOUTS),
    FA3_LAYOUT.relative_path,
    *(layout.relative_path for layout in GRAPH_TABLE_LAYOUTS),
    *ROW_SIZING_FILES,
    INLINE_ROW_FILE,
)
FILES_READ = (
    "__init__.py",  # an installed package (after `pip uninstall sglang` only backups remain)
    *VERSION_FILES,
    *(layout.relative_path for layout in LAYOUTS),
    FA3_LAYOUT.relative_path,
    *(layout.relative_path for layout in GRAPH_TABLE_LAYOUTS),
    *ROW_SIZING_FILES,
    SPEC_V2_DECODE_FILE,
    INLINE_ROW_FILE,
    INLINE_ALLOC_FILE,
    PLUGIN_API_FILE,
    *PLUGINLESS_LAUNCHERS,
)


# ------------------------------------------------------------------------------ the release's form


@dataclass(frozen=True)
class Form:
    """How a release's spec-v2 decode sizes and fills a ``req_to_token`` row (bug #2's arithmetic)."""

    name: str  # the first release of this form; the version the arithmetic is judged as
    first: tuple
    row_sizing: str  # "inline" (model_runner), "common" (mem_cache/common.py), "allocation_sizing"
    # The prepare pre-claims the bonus slot (``kv_committed_len += 1``, 0.5.14
    # speculative/eagle_info_v2.py:62): the last prepare sees context_len - 3 under overlap.
    # From 0.5.15 the bonus is committed in resolve (eagle_utils.py:791-793): context_len - 4.
    preclaims_bonus: bool
    # ``nxt`` is rounded up to the allocator's page (0.5.16 allocation_sizing.py:54-57).
    page_aligns_reservation: bool
    # get_alloc_len_per_decode exempts algorithms without draft KV (NGRAM) from the per-page
    # branch sizing (0.5.14 mem_cache/common.py:211-239; 0.5.13 :155-182 does not).
    exempts_draftless: bool
    # The row's headroom holds the allocator page (page_size x dcp_size), not only page_size,
    # where nxt is rounded (sglang's own ``get_alloc_page_size`` in the sizing module).
    row_holds_alloc_page: bool
    files_say: str  # what in the files shows this form


# Newest first. A version label picks its row only where the files cannot tell two forms apart
# (0.5.13 / 0.5.14, NGRAM's exemption); everywhere else ``detected_form`` decides. Columns as in
# ``Form``: name, first release, row sizing, pre-claims the bonus, page-aligns nxt, exempts
# draftless algorithms, row holds the allocator page, what the files show.
FORMS = tuple(
    Form(*row)
    for row in (
        ("0.5.19", (0, 5, 19), "allocation_sizing", False, True, True, True,
         "the row is sized by the allocator's page (get_alloc_page_size, 0.5.19+)"),
        ("0.5.16", (0, 5, 16), "allocation_sizing", False, True, True, False,
         "the row is sized in mem_cache/allocation_sizing.py by page_size alone (0.5.16 - 0.5.18)"),
        ("0.5.15", (0, 5, 15), "common", False, False, True, False,
         "the row is sized in mem_cache/common.py without a pre-claim (0.5.15)"),
        ("0.5.14", (0, 5, 14), "common", True, False, True, False,
         "the spec-v2 prepare pre-claims the bonus slot (0.5.11 - 0.5.14)"),
        ("0.5.13", (0, 5, 13), "common", True, False, False, False,
         "the spec-v2 prepare pre-claims the bonus slot (0.5.11 - 0.5.14)"),
        ("0.5.9", (0, 5, 9), "inline", True, False, False, False,
         "the row is sized inline in model_runner_kv_cache_mixin.py (0.5.9 - 0.5.12)"),
    )
)  # fmt: skip

# A release this tool cannot place: the safer choice of each fact (the smaller committed margin,
# a rounded nxt, the smaller reservation for NGRAM).
UNKNOWN_FORM = Form(
    "unknown",
    (0, 0, 0),
    "allocation_sizing",
    preclaims_bonus=True,
    page_aligns_reservation=True,
    exempts_draftless=True,
    row_holds_alloc_page=False,
    files_say="",
)


def form_for(version: Optional[str]) -> Form:
    """The form a version label names: ``UNKNOWN_FORM`` for an unparsable one, the oldest form
    for a release older than every form."""
    if parse_version(version) is None:
        return UNKNOWN_FORM
    return next((form for form in FORMS if at_least(version, form.first)), FORMS[-1])


def detected_form(
    label: Optional[str], preclaims: bool, sizing: Optional[str], holds_alloc_page: bool
) -> tuple:
    """(the release's ``Form``, note) from what the files show: ``preclaims`` (the spec-v2 prepare
    pre-claims the bonus slot), ``sizing`` (``"common"`` / ``"allocation_sizing"``: the module
    that defines the row sizing function, None if none) and ``holds_alloc_page`` (that module
    sizes the row by ``get_alloc_page_size``). The label's form stands where the files agree
    with it (or show nothing: the label is all there is); else the files win and the note says so."""
    named = form_for(label)
    if preclaims:  # an unknown label keeps its own (pre-claiming) arithmetic
        shown = next(f for f in FORMS if f.preclaims_bonus and f.row_sizing == "common")
        fits = named.preclaims_bonus
    elif sizing is not None:
        shown = next(
            f
            for f in FORMS
            if f.row_sizing == sizing and not f.preclaims_bonus and f.row_holds_alloc_page == holds_alloc_page
        )
        fits = named is shown
    else:
        return named, ""
    if fits:
        return named, ""
    return shown, f"the files contradict the version {label}: {shown.files_say}; judged as {shown.name}"


# ------------------------------------------------------------------------------ speculative algorithms

# The decode prepare each speculative algorithm runs under spec v2, by sglang's own member name
# (``SpeculativeAlgorithm``: 0.5.14 speculative/spec_info.py:28-41, 0.5.23 :32-47; NEXTN is an
# alias of EAGLE, never a member). Every member a release registers must be here:
# ``algorithms_without_rule`` names the others and the bug #2 tier fails on them (no silent default).
EAGLE_PREPARE = "eagle"  # the spec-v2 EAGLE prepare: kv_committed_len + 2A, no row check
DFLASH_PREPARE = "dflash"  # DFlashDraftInputV2.prepare_for_decode: 2 x block, no row check
UNO_PREPARE = "uno"  # UnoDraftInput.prepare_for_decode: 2 x (D + 1); raises past the row itself
DECODE_PREPARE = {
    "NONE": None,  # no speculative decoding
    "EAGLE": EAGLE_PREPARE,  # and multi-layer EAGLE
    "NEXTN": EAGLE_PREPARE,  # an alias sglang resolves to EAGLE (0.5.23 speculative/spec_registry.py:183)
    "EAGLE3": EAGLE_PREPARE,
    "STANDALONE": EAGLE_PREPARE,
    # 0.5.14+: NgramVerifyInput mixes in EagleDraftInputV2Mixin (0.5.14 ngram_info.py:13).
    "NGRAM": EAGLE_PREPARE,
    # 0.5.14+: FrozenKVMTPWorkerV2 subclasses EAGLEWorkerV2 (0.5.23
    # speculative/frozen_kv_mtp_worker_v2.py:698) and reserves nothing itself (:467-470);
    # sglang's dispatch sends it to the EAGLE prepare: 0.5.14 managers/schedule_batch.py:2617-2622
    # calls its FrozenKVMTPDraftInput's (an EagleDraftInput, frozen_kv_mtp_info.py:44), 0.5.15+
    # spec_utils.spec_prepare_for_decode's else branch (0.5.23 spec_utils.py:1267-1270). The bug #2
    # CPU tier drives that dispatch (proof/row_overflow.py). 0.5.12 / 0.5.13 run it on spec v1 only
    # (0.5.13 speculative/spec_info.py:148-149, :178-184): no spec-v2 prepare there.
    "FROZEN_KV_MTP": EAGLE_PREPARE,
    # 0.5.14+ (0.5.14 speculative/dflash_info_v2.py:131; 0.5.23 :142-154).
    "DFLASH": DFLASH_PREPARE,
    # 0.5.16+: DFLASH's family (0.5.16 spec_info.py:118-119); its worker requires a
    # DFlashDraftInputV2 (0.5.23 speculative/dspark_components/dspark_worker_v2.py:35, :969-973).
    "DSPARK": DFLASH_PREPARE,
    # 0.5.20+: its own prepare (speculative/uno_info.py:81, the same through 0.5.23; dispatched by
    # 0.5.20 spec_utils.py:1093-1098), page-aligned, reserving 2 x (D + 1) (0.5.20
    # mem_cache/allocation_sizing.py:36-40), and the only one that raises when nxt passes the row
    # (uno_info.py:141-146); its row holds the reservation (allocation_sizing.py:101-104).
    # Driven on CPU by the bug #2 tier.
    "UNO": UNO_PREPARE,
}


def decode_prepare(algorithm: Optional[str]) -> Optional[str]:
    """The decode prepare of a resolved ``speculative_algorithm`` (None: no speculative
    decoding); KeyError for an algorithm this table has no rule for."""
    name = "NONE" if algorithm is None else str(algorithm).upper()
    return DECODE_PREPARE[name]


def algorithms_without_rule(members) -> list:
    """The member names of a release's ``SpeculativeAlgorithm`` that ``DECODE_PREPARE`` lacks."""
    return sorted(str(name).upper() for name in members if str(name).upper() not in DECODE_PREPARE)


# ------------------------------------------------------------------------------ the watch's targets


@dataclass(frozen=True)
class WatchTarget:
    """One place a watched function lives, for the releases in [since, until] (None: open)."""

    kind: str
    target: str  # dotted path, as HookRegistry resolves it
    buffer: str  # what the checked width is the width of
    since: tuple
    until: Optional[tuple] = None

    def covers(self, version: Optional[str]) -> bool:
        if parse_version(version) is None:
            return True  # unknown release: let resolution decide
        if not at_least(version, self.since):
            return False
        return self.until is None or not at_least(version, (*self.until[:2], self.until[2] + 1))
