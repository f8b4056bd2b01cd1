"""In the resolution child, sglang's and torch's device queries answered from a GPU profile."""

from __future__ import annotations

import functools
import sys


def profile_patches(profile: dict) -> list:
    """mock patches answering sglang's and torch's device queries from ``profile``."""
    from sglang.srt.utils import common

    fakes = {
        name: _answer(value) for name, value in _sglang_answers(profile).items() if hasattr(common, name)
    }
    _forget_cached_answers()
    return [*_rebound_references(common, fakes), *_torch_patches(profile)]


def _sglang_answers(profile: dict) -> dict:
    """What each of sglang's device probes (``sglang.srt.utils.common``) answers for ``profile``."""
    cuda, hip = profile["vendor"] == "cuda", profile["vendor"] == "hip"
    major, minor = profile["capability"]
    capability = (major, minor)
    return {
        "is_cuda": cuda,
        "is_hip": hip,
        "is_cuda_alike": True,
        "is_npu": False,
        "is_xpu": False,
        "is_musa": False,
        "is_mps": False,
        "is_hpu": False,
        "is_cpu": False,
        "is_sm80_supported": cuda and major == 8,
        "is_sm90_supported": cuda and major == 9,
        "is_sm100_supported": cuda and major == 10,
        "is_sm110_supported": cuda and major == 11,
        "is_sm100_or_sm110_supported": cuda and major in (10, 11),
        "is_sm120_supported": cuda and major == 12,
        "is_blackwell_supported": cuda and major in (10, 11, 12),
        "is_blackwell": cuda and major in (10, 11, 12),
        "is_hopper_with_cuda_12_3": cuda and major == 9,
        "is_ampere_with_cuda_12_3": cuda and major == 8,
        "is_gfx942_supported": hip and profile.get("arch") == "gfx942",
        "is_gfx95_supported": hip and profile.get("arch") == "gfx950",
        "is_flashinfer_available": cuda,
        "get_device_sm": major * 10 + minor,
        "get_device_capability": capability,
        "get_device_memory_capacity": profile["mem_mib"],
        "get_nvgpu_memory_capacity": profile["mem_mib"],
        "get_amdgpu_memory_capacity": profile["mem_mib"],
    }


def _answer(value):
    """A stand-in for a probe, lru-cached or not, that returns ``value``."""
    fake = lambda *args, **kwargs: value  # noqa: E731
    fake.cache_clear = lambda: None  # callers clear lru caches
    return fake


def _sglang_modules() -> list:
    """The sglang modules loaded now."""
    return [m for name, m in list(sys.modules.items()) if name.startswith("sglang") and m]


def _forget_cached_answers() -> None:
    # Answers cached on the CPU at import time (0.5.23 dsa/utils.py's
    # aiter_can_use_preshuffle_paged_mqa, first called at dsa_indexer.py:134) are forgotten.
    for module in _sglang_modules():
        for value in list(vars(module).values()):
            if isinstance(value, functools._lru_cache_wrapper):  # no getattr: lazy proxies import
                value.cache_clear()


def _rebound_references(common, fakes: dict) -> list:
    """Patches putting ``fakes`` in place of every sglang module's reference to the originals."""
    from unittest import mock

    # Modules imported `from ...common import is_cuda`: rebind every reference to the originals.
    originals = {id(getattr(common, name)): name for name in fakes}
    patches = []
    for module in _sglang_modules():
        for attr, value in list(vars(module).items()):
            if id(value) in originals:
                patches.append(mock.patch.object(module, attr, fakes[originals[id(value)]]))
    return patches


def _torch_patches(profile: dict) -> list:
    """Patches answering torch.cuda's device queries and torch.version's from ``profile``."""
    from types import SimpleNamespace
    from unittest import mock

    import torch

    cuda, hip = profile["vendor"] == "cuda", profile["vendor"] == "hip"
    major, minor = profile["capability"]
    properties = SimpleNamespace(
        name=profile["name"],
        total_memory=profile["mem_mib"] << 20,
        major=major,
        minor=minor,
        multi_processor_count=132,
        gcnArchName=profile.get("arch", ""),
    )
    patches = []
    for name, value in {
        "is_available": True,
        "device_count": 8,
        "get_device_capability": (major, minor),
        "get_device_properties": properties,
        "get_device_name": profile["name"],
        "mem_get_info": (properties.total_memory, properties.total_memory),
        "current_device": 0,
    }.items():
        patches.append(mock.patch.object(torch.cuda, name, _answer(value)))
    patches.append(mock.patch.object(torch.version, "cuda", "12.9" if cuda else None))
    patches.append(mock.patch.object(torch.version, "hip", "6.4.0" if hip else None))
    return patches
