"""What a row-overflow drive observes, depending on no fix: every row write, every prepare that ran."""

from __future__ import annotations

import contextlib
import importlib
from unittest import mock

from sglang_dsa_fix import release


def writer_module():
    """The module whose ``assign_req_to_token_pool_func`` the spec-v2 prepare calls: 0.5.16+
    mem_cache/allocation.py (a module global there), before that speculative/spec_utils.py
    (imported at call time)."""
    for name in ("sglang.srt.mem_cache.allocation", "sglang.srt.speculative.spec_utils"):
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            if hasattr(module, "assign_req_to_token_pool_func"):
                return module
    raise RuntimeError("this sglang has no assign_req_to_token_pool_func")


class WriteRecorder:
    """Records [start, end) of every real ``assign_req_to_token_pool_func`` call, then runs it."""

    def __init__(self):
        self.module = writer_module()
        self.real = self.module.assign_req_to_token_pool_func
        self.furthest = -1
        self.writes = []  # (start, end, row width) of every row of every call

    def __call__(self, req_pool_indices, req_to_token, start, end, out_cache_loc, bs):
        if bs:
            self.furthest = max(self.furthest, int(end[:bs].max()) - 1)
            row_width = req_to_token.shape[1]
            self.writes += [(s, e, row_width) for s, e in zip(start[:bs].tolist(), end[:bs].tolist())]
        return self.real(req_pool_indices, req_to_token, start, end, out_cache_loc, bs)

    @contextlib.contextmanager
    def installed(self):
        """Around every loaded sglang module that holds the writer as a global: the EAGLE
        prepare imports it at call time, DFLASH's module at import (0.5.14
        speculative/dflash_info_v2.py), as HookRegistry propagates a hook to every importer."""
        import sys

        holders = [self.module] + [
            module
            for name, module in list(sys.modules.items())
            if name.startswith("sglang.")
            and module is not self.module
            and getattr(module, "assign_req_to_token_pool_func", None) is self.real
        ]
        with contextlib.ExitStack() as stack:
            for module in holders:
                stack.enter_context(mock.patch.object(module, "assign_req_to_token_pool_func", self))
            yield


# Where each decode prepare of ``release.DECODE_PREPARE`` lives: (module, class or None, name).
PREPARE_SITES = {
    release.EAGLE_PREPARE: (
        ("sglang.srt.speculative.eagle_utils", None, "eagle_prepare_for_decode"),  # 0.5.15+
        ("sglang.srt.speculative.eagle_info_v2", "EagleDraftInputV2Mixin", "prepare_for_decode"),
    ),
    release.DFLASH_PREPARE: (
        ("sglang.srt.speculative.dflash_info_v2", "DFlashDraftInputV2", "prepare_for_decode"),
    ),
    release.UNO_PREPARE: (("sglang.srt.speculative.uno_info", "UnoDraftInput", "prepare_for_decode"),),
}


class PrepareSpy:
    """Records which of the release's decode prepares ran (each still runs as it is): the
    observer that says a dispatched algorithm reached the prepare ``release.DECODE_PREPARE``
    names. Sites missing from this release are skipped; the EAGLE prepare is looked up at call
    time by every caller (spec_utils imports it inside the dispatch, a draft input's method
    resolves through its class), so patching the defining module / class reaches them."""

    def __init__(self):
        self.ran = set()

    @contextlib.contextmanager
    def installed(self):
        from importlib.util import find_spec

        with contextlib.ExitStack() as stack:
            for label, sites in PREPARE_SITES.items():
                for module_name, owner_name, name in sites:
                    if find_spec(module_name) is None:
                        continue
                    owner = importlib.import_module(module_name)
                    owner = getattr(owner, owner_name, None) if owner_name else owner
                    real = getattr(owner, name, None) if owner is not None else None
                    if real is None or (owner_name and name not in vars(owner)):
                        continue
                    stack.enter_context(mock.patch.object(owner, name, self._wrap(label, real)))
            yield

    def _wrap(self, label, real):
        def recorded(*args, **kwargs):
            self.ran.add(label)
            return real(*args, **kwargs)

        return recorded
