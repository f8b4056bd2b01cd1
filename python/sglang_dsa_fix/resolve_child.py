"""The resolution child's side of ``resolve``: runs in the target environment's Python, started
by ``resolve.resolve`` (its ``BOOT``), imports sglang there, resolves the launch arguments with
sglang's own argument processing under a GPU profile, reads sglang's own widths and prints one
result line (``resolve_result.RESULT_MARK``) the parent reads with a schema. The parent side
imports neither torch nor sglang; this module imports them only inside its functions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from sglang_dsa_fix import backend_layouts, runtime_fix, safe_files, width
from sglang_dsa_fix.gpu_profile_patches import profile_patches
from sglang_dsa_fix.resolve_prove import prove
from sglang_dsa_fix.resolve_result import FIELDS, MAX_PATH_ENTRY, MAX_SYS_PATH, RESULT_MARK


def _preimport() -> None:
    """Import the resolution modules first, so the profile patches reach their references."""
    import importlib
    import pkgutil

    import sglang.srt.server_args  # noqa: F401

    for package in ("sglang.srt.arg_groups",):
        try:
            module = importlib.import_module(package)
        except ImportError:
            continue
        for info in pkgutil.walk_packages(module.__path__, package + "."):
            try:
                importlib.import_module(info.name)
            except Exception:  # optional backends' modules
                continue
    for name in (
        "sglang.srt.configs.model_config",
        "sglang.srt.speculative.spec_info",
        "sglang.srt.speculative.dflash_utils",
        "sglang.srt.layers.attention.dsa.utils",
        "sglang.srt.mem_cache.common",
        "sglang.srt.mem_cache.allocation_sizing",
    ):
        try:
            importlib.import_module(name)
        except ImportError:
            continue


def _resolve(launch_args: list):
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(launch_args)
    if hasattr(server_args, "resolve_once"):  # 0.5.23: resolution is explicit (server_args.py:247)
        server_args.resolve_once()
    return server_args


def _warm_up(launch_args: list) -> None:
    """One throw-away resolution on this machine's own answers, so that modules sglang's handlers
    import lazily are imported without the profile (under it, ``is_cuda()`` makes 0.5.23's
    dflash_utils import sgl_kernel, a CUDA-only package). Environment writes are undone."""
    from unittest import mock

    with mock.patch.dict(os.environ):
        try:
            _resolve(launch_args)
        except BaseException:
            pass


# A --config file is read by sglang's ConfigArgumentMerger (yaml.safe_load, then every value
# str()-ed into arguments): a few hundred bytes of nested aliases expand to gigabytes there.
# Checked first (``_config_refusal``): a regular file, at most MAX_CONFIG_BYTES, at most
# MAX_YAML_ALIASES aliases (a merge key ``<<: *defaults`` is one; 8 of them expand a file at most
# some 20 times).
MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_ALIASES = 8


def _config_refusal(argv: list) -> Optional[str]:
    """Why a ``--config FILE`` among the launch arguments is not handed to sglang, or None.
    A file that cannot be opened or parsed is sglang's to report."""
    import stat

    for path in [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--config"]:
        try:  # O_NONBLOCK: a FIFO answers at once, and is refused below
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return f"--config {path}: not a regular file"
            if st.st_size > MAX_CONFIG_BYTES:
                return f"--config {path}: {st.st_size} bytes, over the {MAX_CONFIG_BYTES} byte cap"
            with os.fdopen(os.dup(fd), "rb") as handle:
                data = handle.read(MAX_CONFIG_BYTES + 1)
        except OSError:
            continue
        finally:
            os.close(fd)
        try:
            import yaml

            aliases = sum(
                isinstance(token, yaml.AliasToken)
                for token in yaml.scan(data.decode("utf-8", "replace"), Loader=yaml.SafeLoader)
            )
        except Exception:  # no yaml here, or not YAML: sglang says so
            continue
        if aliases > MAX_YAML_ALIASES:
            return (
                f"--config {path}: {aliases} YAML aliases, more than {MAX_YAML_ALIASES}: not handed "
                "to sglang (nested aliases expand without bound); write the values out"
            )
    return None


# The directories ``--trust-remote-code`` makes transformers import code from (auto_map's
# ``configuration_*.py``, the tokenizer's and the draft model's), where they are local.
REMOTE_CODE_PATHS = ("model_path", "tokenizer_path", "speculative_draft_model_path")


def _remote_code_refusal(argv: list) -> Optional[str]:
    """As root: why the model's own code is not run (``--trust-remote-code``, on the command line
    or in ``--config``, with a local model directory another user could change), or None."""
    import contextlib
    import io

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            parsed = _given_and_defaults(argv)[0]
    except (Exception, SystemExit):  # sglang's parser rejects them: its resolution says so
        return None
    if not parsed.get("trust_remote_code"):
        return None
    for name in REMOTE_CODE_PATHS:
        where = parsed.get(name)
        if not isinstance(where, str) or not os.path.isdir(where):
            continue  # a hub id: fetched into root's own cache
        flag = "--" + name.replace("_", "-")
        try:
            found = safe_files.code_tree_foreign(os.path.abspath(where))
        except OSError as exc:
            return f"{flag} {where}: cannot check ({exc.strerror or exc}); --trust-remote-code runs its code"
        if found is not None:
            said = ("" if found.path == os.path.abspath(where) else f"{found.path} is ") + found.reason
            return (
                f"{flag} {where}: {said}; with --trust-remote-code its code runs, and as root "
                "sglang-dsa-fix does not run code another user can change (pass --allow-unsafe-dirs "
                "to override)"
            )
    return None


def _given_and_defaults(argv: list) -> tuple:
    """(the parser's values, the dests the arguments set, the dests only ``--config`` sets):
    sglang's own parser, with ``--config FILE`` merged as ``prepare_server_args`` merges it
    (0.5.14 server_args.py:7213-7219, ConfigArgumentMerger: the file's values first, the
    command line after them, so the command line wins)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    merged = argv
    if "--config" in argv:
        from sglang.srt.server_args_config_parser import ConfigArgumentMerger

        merged = ConfigArgumentMerger(parser).merge_config_with_args(argv)
    parsed = vars(parser.parse_args(merged))
    for action in parser._actions:  # what an argument list sets itself, as argparse reads it
        action.default, action.required = argparse.SUPPRESS, False
    given = set(vars(parser.parse_args(merged)))
    if merged is argv:
        return parsed, given, set()
    at = argv.index("--config")
    on_command_line = set(vars(parser.parse_args(argv[:at] + argv[at + 2 :])))
    return parsed, given, given - on_command_line


def _read_fields(server_args, parsed: dict, given: set, from_config: set) -> tuple:
    """(configuration, sources): each field's resolved value and where it came from. 0.5.17+
    record which handler declared a field (``_resolved_overrides``); 0.5.17 writes the result
    onto the fields, 0.5.23 keeps the record raw (``_raw_input``) and resolves on read."""
    declarations = getattr(server_args, "_resolved_overrides", None) or ()
    read = lambda name: getattr(server_args, name)  # noqa: E731
    if getattr(server_args, "_raw_input", None) is not None:
        from sglang.srt.arg_groups.overrides import resolution_result, resolving_view

        view = resolving_view(server_args)
        read = lambda name: resolution_result(server_args, name) if name in parsed else getattr(view, name)  # noqa: E731
    config, sources = {}, {}
    for name in FIELDS:
        try:
            value = read(name)
        except Exception:  # not a field of this release
            continue
        if callable(value):
            continue
        config[name] = value
        by = sorted({source for source, fields in declarations if name in fields})
        if name in parsed and value != parsed[name]:
            sources[name] = "resolved by sglang" + (f" ({', '.join(by)})" if by else "")
        elif name in from_config:
            sources[name] = "config file"
        elif name in given:
            sources[name] = "argument"
        elif name in parsed:
            sources[name] = "sglang default"
    return config, sources


def _context_len(server_args) -> int:
    """The context length sglang serves: the model config's, capped or raised by the flag."""
    try:
        from sglang.srt.arg_groups.model_override_base import model_config_of  # 0.5.23

        return int(model_config_of(server_args).context_len)
    except ImportError:
        return int(server_args.get_model_config().context_len)


def _model_attention_backend(server_args):
    """The backend sglang's ``attn_backend_wrapper`` puts in place of the flag's for this model,
    where it does so for a backend this tool judges (0.5.23 layers/attention/attention_registry.py:
    375-380: a MiniMax sparse model on the NVFP4 stack), by sglang's own predicates; else None."""
    try:
        from sglang.srt.configs.model_config import is_minimax_sparse, uses_minimax_m3_nvfp4_native_stack
    except ImportError:  # a release without that backend
        return None
    try:
        from sglang.srt.arg_groups.model_override_base import model_config_of  # 0.5.23

        model_config = model_config_of(server_args)
    except ImportError:
        model_config = server_args.get_model_config()
    if is_minimax_sparse(model_config.hf_config) and uses_minimax_m3_nvfp4_native_stack(
        model_config.quantization
    ):
        return "MiniMaxSparseNvfp4AttnBackend"  # (the class it builds)
    return None


def _runs_spec_v2(server_args):
    """Whether the scheduler runs this algorithm's spec-v2 decode path (bug #2's reservation):
    sglang's own ``ScheduleBatch.is_spec_v2`` on a batch with the scheduler's two fields
    (0.5.9 - 0.5.12: overlap on, managers/schedule_batch.py 0.5.12:2280-2284; 0.5.13: the
    algorithm's ``supports_spec_v2``, :2460-2463, EAGLE and STANDALONE only, whatever the
    overlap); None where the release has no such predicate (0.5.14+ run every algorithm on spec
    v2) or no algorithm. The predicate is found in the file first: 0.5.14+ skip the import."""
    import importlib.util
    import inspect
    from pathlib import Path
    from types import SimpleNamespace

    algorithm = getattr(server_args, "speculative_algorithm", None)
    spec = importlib.util.find_spec("sglang.srt.managers.schedule_batch")
    if not algorithm or spec is None or b"def is_spec_v2(" not in Path(spec.origin).read_bytes():
        return None
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    predicate = inspect.getattr_static(ScheduleBatch, "is_spec_v2")
    predicate = predicate.fget if isinstance(predicate, property) else predicate
    batch = SimpleNamespace(
        enable_overlap=not server_args.disable_overlap_schedule,
        spec_algorithm=SpeculativeAlgorithm.from_string(algorithm),
    )
    try:
        return bool(predicate(batch))
    except AssertionError:  # 0.5.9 - 0.5.12: overlap on for an algorithm without spec v2
        return False


def _widths(server_args) -> dict:
    """sglang's own row headroom and decode reservation for these server args."""
    import inspect

    module = runtime_fix.sizing_module()
    if module is None:
        return {}
    extra, reserve = module.get_req_to_token_extra_context_len, module.get_alloc_reserve_per_decode
    call = (server_args,) if inspect.signature(extra).parameters else ()  # 0.5.13 - 0.5.17 take it
    if not call:  # 0.5.18+ read the published runtime context
        from sglang.srt.runtime_context import publish

        publish(server_args, role="test")
    page = getattr(module, "get_alloc_page_size", None)
    with runtime_fix.dcp_group_widths(getattr(server_args, "dcp_size", 1) or 1):  # as the server's groups
        out = {"row_extra": extra(*call), "decode_reserve": reserve(*call)}
        # What the plugin's own hook makes of it, called as sglang calls the function.
        out["row_extra_with_plugin"] = runtime_fix.row_extra_fix(module.__name__)(out["row_extra"], *call)
        # The allocator's page: sglang's own get_alloc_page_size() (0.5.19+), else the one rule
        # (page_size x dcp_size, what 0.5.15 - 0.5.18 page the allocator by).
        own = page is not None and not inspect.signature(page).parameters
        out["alloc_page_size"] = int(page()) if own else width.alloc_page_size(server_args)
    out["sizing_function"] = f"{module.__name__}.get_req_to_token_extra_context_len"
    return {
        k: int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for k, v in out.items()
    }


def _graph_page_table_width(config: dict, widths: dict) -> dict:
    """Bug #1's buffer as the tree's own DSA/NSA backend allocates it: its
    ``init_cuda_graph_state`` run on CPU (bs 1) over a ``req_to_token`` of the width sglang
    sizes for this configuration; the width of the graph ``page_table`` it allocated. Empty
    where the configuration has no DSA graph (the verdict then says why) or the backend cannot
    be built here (the parent then evaluates the file's expression, and says so)."""
    algorithm, D = config.get("speculative_algorithm"), config.get("speculative_num_draft_tokens") or 0
    if (
        not algorithm
        or config.get("disable_cuda_graph")
        or width.decode_backend(config) not in backend_layouts.DSA_BACKENDS
    ):
        return {}
    if "row_extra" not in widths:
        return {}
    try:
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from sglang_dsa_fix.proof import replay

        _, backend_cls = replay.import_backend_class()
        if backend_cls is None:
            return {}
        C = int(config["context_length"])
        pool = ReqToTokenPool(
            size=1, max_context_len=C + widths["row_extra"], device="cpu", enable_memory_saver=False
        )
        case = replay.Case(C, D, config.get("page_size") or 1, 1)
        backend = replay.make_backend(backend_cls, case, pool)
        backend.init_cuda_graph_state(1, D)
        table = width.graph_page_table(backend)
    except Exception as exc:  # attributes a release reads that make_backend does not set
        return {"graph_page_table_error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    if table is None:
        return {}
    return {
        "graph_page_table_width": int(table.shape[1]),
        "graph_page_table_from": f"{backend_cls.__module__}.{backend_cls.__name__}.init_cuda_graph_state",
    }


def child_main(argv: list, sys_path: Optional[list] = None) -> None:
    """In the target environment: print one RESULT_MARK line of JSON, whatever happens.
    ``sys_path``: this interpreter's own path before the boot line put the tree and this package
    first; reported (``""``, the working directory, as its absolute path) for the plugin lookup."""
    result = _child_result(argv)
    if sys_path is not None:
        # Started isolated (``ISOLATED``): no entry is the working directory ("").
        entries = [entry for entry in sys_path if isinstance(entry, str) and os.path.isabs(entry)]
        result["sys_path"] = [e for e in entries if len(e) <= MAX_PATH_ENTRY][:MAX_SYS_PATH]
    _emit(result)


def _child_result(argv: list) -> dict:
    import contextlib
    import io
    import logging

    options, launch_args = json.loads(argv[0]), argv[1:]
    profile = options["profile"]
    # argparse names itself after sys.argv[0] ("-c" here): sglang's parser errors read as the
    # launcher's, the program the operator ran.
    sys.argv[0] = "sglang.launch_server"
    refused = _config_refusal(launch_args)
    if refused is not None:
        return {"error_kind": "refused", "error": refused}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            _preimport()
            import sglang
    except Exception as exc:  # ImportError, or a broken environment: the static rule takes over
        return {"error_kind": "import", "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    refused = _remote_code_refusal(launch_args) if options.get("guard") else None
    if refused is not None:
        return {"error_kind": "refused", "error": refused}
    logging.disable(logging.CRITICAL)
    errors = io.StringIO()
    try:
        with contextlib.ExitStack() as stack, contextlib.redirect_stdout(io.StringIO()):
            stack.enter_context(contextlib.redirect_stderr(errors))
            _warm_up(launch_args)
            for patch in profile_patches(profile):
                stack.enter_context(patch)
            parsed, given, from_config = _given_and_defaults(launch_args)
            server_args = _resolve(launch_args)
            config, sources = _read_fields(server_args, parsed, given, from_config)
            config["context_length"] = _context_len(server_args)
            config["model_attention_backend"] = _model_attention_backend(server_args)
            config["speculative_runs_spec_v2"] = _runs_spec_v2(server_args)
            widths = _widths(server_args)
    except SystemExit as exc:  # argparse: its message went to stderr
        said = (errors.getvalue().strip().splitlines() or [f"sglang's parser exited ({exc.code})"])[-1]
        return {"error_kind": "arguments", "error": said}
    except BaseException as exc:
        said = f"{type(exc).__name__}: {exc}".splitlines()[0]
        needs_config = _model_config_missing(launch_args)
        if needs_config:
            return {"error_kind": "model_config", "error": f"{needs_config} ({said})"}
        return {"error_kind": "arguments", "error": said}
    widths.update(_graph_page_table_width(config, widths))
    result = {
        "sglang_version": getattr(sglang, "__version__", None),
        "configuration": config,
        "sources": sources,
        "widths": widths,
    }
    if options.get("prove"):
        result["prove"] = prove(config, widths)
    return result


def _model_config_missing(launch_args: list) -> str:
    """Why sglang could not read the model's ``config.json`` (its resolution reads the model
    config: context length, architecture), where the model path is not a local directory holding
    one; "" where it is (the failure was then something else)."""
    import contextlib
    import io

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            model = _given_and_defaults(launch_args)[0].get("model_path")
    except (Exception, SystemExit):
        return ""
    if not isinstance(model, str) or os.path.isfile(os.path.join(model, "config.json")):
        return ""
    if not os.path.isdir(model):
        try:  # a hub id whose config.json the hub gave (now in HF's cache): not the failure
            from huggingface_hub import try_to_load_from_cache

            if isinstance(try_to_load_from_cache(model, "config.json"), str):
                return ""
        except Exception:  # not a valid repo id either: the config is what is missing
            pass
    where = (
        f"--model-path {model} has no config.json"
        if os.path.isdir(model)
        else f"--model-path {model} is not a local directory and the hub (or its HF cache) did not give "
        "its config.json"
    )
    return (
        f"sglang needs the model's config.json to resolve the launch arguments: {where}; pass a local "
        "directory holding config.json (the weights are not read), or run where the hub or HF_HOME's "
        "cache has it"
    )


MAX_CHILD_ERROR = 2000  # characters of an error the child reports (argparse can quote megabytes)


def _emit(result: dict) -> None:
    if isinstance(result.get("error"), str) and len(result["error"]) > MAX_CHILD_ERROR:
        result["error"] = result["error"][:MAX_CHILD_ERROR] + f"... ({len(result['error'])} characters, cut)"
    print(RESULT_MARK + json.dumps(result, default=str), flush=True)
