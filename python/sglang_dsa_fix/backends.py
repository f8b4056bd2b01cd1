"""Where each sglang release keeps the code this project fixes.

Bug #1, the DSA/NSA attention backend: found by layout, not by version string, so patched forks and release candidates work too:
- 0.5.13+: layers/attention/dsa_backend.py, class DeepseekSparseAttnBackend
  (0.5.13 - 0.5.20 also ship nsa_backend.py as a re-export shim: skipped, it has no class body);
- 0.5.3 - 0.5.12: layers/attention/nsa_backend.py, class NativeSparseAttnBackend.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_DIR = "srt/layers/attention"

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


@dataclass(frozen=True)
class BackendLayout:
    module: str  # dotted module name
    class_name: str
    multi_step_class_name: str

    @property
    def relative_path(self) -> str:
        """Path under ``sglang/``."""
        return f"{ATTENTION_DIR}/{self.module.rsplit('.', 1)[1]}.py"

    @property
    def hook_target(self) -> str:
        return f"{self.module}.{self.class_name}.init_cuda_graph_state"


# Newest first: the first layout whose file defines the class wins.
LAYOUTS = (
    BackendLayout(
        "sglang.srt.layers.attention.dsa_backend",
        "DeepseekSparseAttnBackend",
        "DeepseekSparseAttnMultiStepBackend",
    ),
    BackendLayout(
        "sglang.srt.layers.attention.nsa_backend",
        "NativeSparseAttnBackend",
        "NativeSparseAttnMultiStepBackend",
    ),
)

# Launch paths that build a Scheduler without calling load_plugins(): the plugin never runs
# there (0.5.11 - 0.5.23 ray/scheduler_actor.py:104, 0.5.23 :113). Found by reading the file.
PLUGINLESS_LAUNCHERS = {"srt/ray/scheduler_actor.py": "RayEngine (sglang.srt.ray)"}

VERSION_FILES = ("_version.py", "version.py")
PLUGIN_API_FILE = "srt/plugins/hook_registry.py"
# Every file under ``sglang/`` the tool reads: enough to copy for a disposable test tree.
FILES_READ = (
    "__init__.py",  # an installed package (after `pip uninstall sglang` only backups remain)
    *VERSION_FILES,
    *(layout.relative_path for layout in LAYOUTS),
    *ROW_SIZING_FILES,
    SPEC_V2_DECODE_FILE,
    INLINE_ROW_FILE,
    INLINE_ALLOC_FILE,
    PLUGIN_API_FILE,
    *PLUGINLESS_LAUNCHERS,
)
