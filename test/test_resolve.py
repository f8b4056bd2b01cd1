"""``status -- <launch_server args>``: sglang's own argument processing (in a child process of the
target Python) decides the configuration, and the tree's own sizing functions the widths.

Each case resolves once (~8 s on the CI machine): the child imports torch and sglang.
"""

import json
import os
import shutil
import stat
import sys
import sysconfig
import tempfile
import unittest
from pathlib import Path
from unittest import mock

from helpers import INSTALLED, run_cli

from sglang_dsa_fix import release
from sglang_dsa_fix import tree as trees

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}
NGRAM = ["--speculative-algorithm", "ngram", "--context-length", "4096", "--device", "cuda"]
# A DeepSeek-V3.2 (DSA) config.json with the sm90 constraints sglang's DSA path checks.
DSV32 = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    "num_nextn_predict_layers": 1,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "torch_dtype": "bfloat16",
}


def eagle(steps: int, draft_tokens: int, context_length: int = 512) -> list:
    return [
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-num-steps",
        str(steps),
        "--speculative-num-draft-tokens",
        str(draft_tokens),
        "--speculative-eagle-topk",
        "1",
        "--context-length",
        str(context_length),
        "--device",
        "cuda",
    ]


def link_tree(source: Path, target: Path, real: set) -> None:
    """``target`` as ``source`` through symlinks: the directories in ``real`` (relative paths) and
    their parents are real directories (with their ``__pycache__``) whose files are links, so that
    a file there can be replaced without touching ``source`` (Python, too, replaces a stale .pyc
    link rather than writing through it); every other directory is one link. Linking sglang's
    ~5600 files one by one made the clean-up take ~15 s (each long link frees a block)."""
    keep = {Path(".")} | {parent for p in real for parent in (p, *p.parents)}

    def copy(relative: Path):
        (target / relative).mkdir(parents=True)
        for entry in (source / relative).iterdir():
            inner = relative / entry.name
            if entry.is_dir() and not entry.is_symlink() and (inner in keep or entry.name == "__pycache__"):
                copy(inner)
            else:
                (target / inner).symlink_to(entry)

    copy(Path("."))


class TestResolvedBySglang(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = Path(tempfile.mkdtemp(prefix="dsa-fix-resolve-"))
        cls.model = cls.tmp / "llama"
        cls.model.mkdir()
        (cls.model / "config.json").write_text(json.dumps(LLAMA))
        cls.dsa_model = cls.tmp / "dsv32"
        cls.dsa_model.mkdir()
        (cls.dsa_model / "config.json").write_text(json.dumps(DSV32))
        # The installed sglang, linked into a site dir of its own (no plugin there): files the test
        # edits are replaced by real copies.
        cls.site = cls.tmp / "site"
        link_tree(INSTALLED.package, cls.site / "sglang", {Path(p).parent for p in release.FILES_READ})

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def status(self, *launch_args, extra=()):
        # The plugin is looked for on the target interpreter's sys.path (issue 27 f), here this
        # Python's, which has the test run's own install: judged as a server without it
        # (test_plugin_lookup.py covers the lookup).
        with mock.patch.object(trees, "plugin_found_on", return_value=None):
            rc, out, err = run_cli(
                "status", "--json", "--sglang-root", str(self.site), *extra, "--", *launch_args
            )
        report = json.loads(out)
        self.assertEqual(rc, report["exit_code"], err)
        return rc, report, err

    def bug(self, report, name):
        return next(b for b in report["bugs"] if b["bug"] == name)

    def edit(self, relative, old, new):
        path = self.site / "sglang" / relative
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data.replace(old, new, 1))
        self.addCleanup(lambda: (path.unlink(), path.symlink_to(INSTALLED.package / relative)))

    def test_ngram_as_sglang_resolves_it_and_the_decode_path_agrees(self):
        # Part of the arguments in a --config file, as sglang takes it (the command line wins).
        config_file = self.tmp / "server.yaml"
        config_file.write_text("context-length: 2048\ndecode-attention-backend: triton\n")
        rc, report, _ = self.status(
            "--config", str(config_file), "--model-path", str(self.model), *NGRAM, extra=("--prove",)
        )
        self.assertEqual(report["basis"], "sglang")
        config, sources = report["configuration"], report["sources"]
        # sglang 0.5.14 fills NGRAM's own defaults (arg_groups/speculative_hook.py).
        self.assertEqual(
            (config["speculative_num_draft_tokens"], config["speculative_eagle_topk"], config["page_size"]),
            (12, 10, 1),
        )
        self.assertEqual(config["speculative_algorithm"], "NGRAM")
        self.assertTrue(sources["speculative_num_draft_tokens"].startswith("resolved by sglang"))
        self.assertEqual(sources["context_length"], "argument")  # 4096 on the command line wins
        self.assertEqual(config["context_length"], 4096)
        self.assertEqual(
            (config["decode_attention_backend"], sources["decode_attention_backend"]),
            ("triton", "config file"),
        )
        row = self.bug(report, "req_to_token_row")
        at = row["at_configuration"]
        # Row 4 + 12 = 16, reservation 2·12 = 24, the last prepare at context_len - 3: 5 columns.
        self.assertEqual((at["row_extra"], at["decode_reserve"], at["columns_past_row_end"]), (16, 24, 5))
        self.assertEqual((row["state"], rc), ("affected", 1))
        # --prove: sglang's real decode path (Triton interpreter) writes exactly those columns.
        measured = at["measured"]
        self.assertEqual((measured["columns_past_row_end"], measured["neighbour_cells_changed"]), (5, 5))
        self.assertTrue(measured["agrees_with_arithmetic"])
        self.assertEqual(self.bug(report, "page_table")["state"], "not_reachable")  # fa3, not DSA
        # The plugin was looked for on the sys.path the resolution child itself had.
        self.assertEqual(report["plugin"]["interpreter"], sys.executable)
        self.assertIn(sysconfig.get_paths()["purelib"], report["plugin"]["looked_in"])

    def test_sources_as_argparse_reads_the_arguments(self):
        # In this process (no child): abbreviations are arguments, only --config values are the file's.
        from sglang_dsa_fix import resolve_child

        argv = ["--model-path", "x", "--context-len", "4096", "--page", "16"]
        _, given, from_config = resolve_child._given_and_defaults(argv)
        self.assertTrue({"context_length", "page_size"} <= given)
        self.assertEqual(from_config, set())
        config_file = self.tmp / "abbreviated.yaml"
        config_file.write_text("page-size: 64\nmodel-path: y\n")
        parsed, given, from_config = resolve_child._given_and_defaults(
            ["--config", str(config_file), *argv[2:]]
        )
        self.assertEqual((parsed["page_size"], parsed["model_path"]), (16, "y"))  # the command line wins
        self.assertEqual(from_config, {"model_path"})

    def test_widths_come_from_the_trees_own_functions(self):
        sizing = "srt/mem_cache/common.py"
        self.edit(
            sizing,
            b"    return extra\n\n\ndef alloc_token_slots",
            b"    extra += 1\n    return extra\n\n\ndef alloc_token_slots",
        )
        self.edit(
            sizing,
            b"    return 2 * get_alloc_len_per_decode(server_args)",
            b"    return 4 * get_alloc_len_per_decode(server_args)",
        )
        _, report, _ = self.status("--model-path", str(self.model), *NGRAM)
        at = self.bug(report, "req_to_token_row")["at_configuration"]
        self.assertEqual((at["row_extra"], at["decode_reserve"]), (17, 48))
        self.assertEqual(at["columns_past_row_end"], 48 - 3 - 17)

    @unittest.skipUnless(INSTALLED.version == "0.5.14", "bug #1's pristine width C + D is 0.5.14's")
    def test_dsa_graph_width_from_the_backends_own_init_cuda_graph_state(self):
        # DeepSeek-V3.2: sglang resolves page 64 and the dsa backend (model overrides). The graph
        # page_table width is what the tree's own init_cuda_graph_state allocates (C + D on
        # 0.5.14): at D 5 the longest verify (C + 1) reads C + 6 columns, one past it.
        rc, report, _ = self.status("--model-path", str(self.dsa_model), *eagle(4, 5))
        config = report["configuration"]
        self.assertEqual((config["page_size"], config["attention_backend"]), (64, "dsa"))
        page_table = self.bug(report, "page_table")
        at = page_table["at_configuration"]
        self.assertEqual((at["graph_page_table_width"], at["longest_verify_seq_len"]), (517, 513))
        self.assertTrue(
            at["graph_page_table_from"].endswith("DeepseekSparseAttnBackend.init_cuda_graph_state")
        )
        # The plugin is installed in the test's environment, not in this site dir.
        self.assertEqual((page_table["state"], rc), ("affected", 1))
        self.assertEqual(self.bug(report, "req_to_token_row")["state"], "not_reachable")  # page 64, D 5
        # The width is the code's, not the expression's: the same expression over a doubled D.
        self.edit(
            "srt/layers/attention/dsa_backend.py",
            b'        to avoid memory allocations.\n        """\n',
            b'        to avoid memory allocations.\n        """\n        self.speculative_num_draft_tokens *= 2\n',
        )
        rc, report, _ = self.status("--model-path", str(self.dsa_model), *eagle(4, 5))
        page_table = self.bug(report, "page_table")
        self.assertEqual(page_table["at_configuration"]["graph_page_table_width"], 522)
        self.assertEqual((page_table["state"], rc), ("not_reachable", 0))

    def llama_eagle(self, backend: str, page: int, extra=(), launch=()):
        """status of tiny Llama with itself as EAGLE draft (3 / 1 / 4, context 512) on ``backend``."""
        model = str(self.model)
        args = ("--attention-backend", backend, "--page-size", str(page), *eagle(3, 4), *launch)
        return self.status("--model-path", model, "--speculative-draft-model-path", model, *args, extra=extra)

    def test_fa3_deployment_judges_bug_3(self):
        # Llama on FA3 (sglang resolves it from --attention-backend fa3), EAGLE 3 / 1 / 4, context
        # 512: the longest verify (512) reads 516 keys; the graph tables hold ceil(512 / page)
        # pages: page 1 -> 516 read from 512 (4 past), page 16 -> 33 from 32 (1 past); the fixed
        # tables (req_to_token's row, 520 wide here) hold both. Not installed in this site dir.
        for page, table, read in ((1, 512, 516), (16, 32, 33)):
            with self.subTest(page=page):
                rc, report, _ = self.llama_eagle("fa3", page)
                self.assertEqual(report["configuration"]["attention_backend"], "fa3")
                fa3 = self.bug(report, "fa3_page_table")
                at = fa3["at_configuration"]
                self.assertEqual(
                    (at["graph_page_table_pages"], at["longest_verify_pages_read"]), (table, read)
                )
                self.assertEqual((at["pages_past_table"], at["pages_past_table_with_fix"]), (read - table, 0))
                self.assertEqual((fa3["state"], rc), ("affected", 1))
                self.assertEqual(self.bug(report, "page_table")["state"], "not_reachable")  # no DSA

    def test_trtllm_mha_deployment_judges_its_relative(self):
        # Bug #3's relative on TRT-LLM MHA (sglang accepts it for prefill only on SM100: the b200
        # profile), EAGLE 3 / 1 / 4, page 16, context 512: ceil(512 / 16) = 32 pages, the longest
        # verify reads ceil((512 + 4) / 16) = 33 -> 1 past; the fixed table (req_to_token's row, 520
        # wide) holds 33. FA3 and the MLA backends are not reached there.
        rc, report, _ = self.llama_eagle("trtllm_mha", 16, extra=("--gpu", "b200"))
        mha = self.bug(report, "trtllm_mha_page_table")
        at = mha["at_configuration"]
        self.assertEqual((at["graph_page_table_pages"], at["longest_verify_pages_read"]), (32, 33))
        self.assertEqual((at["pages_past_table"], at["pages_past_table_with_fix"]), (1, 0))
        self.assertEqual((mha["state"], rc), ("affected", 1))
        for name in ("fa3_page_table", "trtllm_mla_kv_indices", "flashmla_kv_indices"):
            self.assertEqual(self.bug(report, name)["state"], "not_reachable", name)

    def test_triton_deployment_judges_its_flat_buffers(self):
        # Triton, EAGLE 3 / 1 / 4, context 512: with every request at the longest verify's seq_len
        # (512), the draft decode's last step writes 512 + 3 kv_indices per request into 512, the
        # verify needs 4 * 516 mask cells of 4 * 512 (0.5.14's form); the row (520) holds both.
        rc, report, _ = self.llama_eagle("triton", 1)
        triton = self.bug(report, "triton_kv_indices")
        at = triton["at_configuration"]
        self.assertEqual((at["draft_kv_indices_needed"], at["draft_kv_indices_per_request"]), (515, 512))
        self.assertEqual((at["verify_mask_cells_needed"], at["verify_mask_cells_per_request"]), (2064, 2048))
        self.assertEqual((at["reachable"], at["reachable_with_fix"]), (True, False))
        self.assertEqual((triton["state"], rc), ("affected", 1))
        self.assertEqual(self.bug(report, "fa3_page_table")["state"], "not_reachable")

    def test_triton_without_cuda_graphs_judges_its_eager_draft_buffer(self):
        # CUDA graphs disabled: the graph buffers are gone, but the eager draft decode sizes its
        # kv_indices per batch from context_len, so a lone request at 512 writes 515 into 512
        # (test_graph_tables_flat_buffers.py drives it); no verify mask is sized from C there.
        rc, report, _ = self.llama_eagle("triton", 1, launch=("--disable-cuda-graph",))
        triton = self.bug(report, "triton_kv_indices")
        at = triton["at_configuration"]
        self.assertEqual((at["draft_kv_indices_needed"], at["draft_kv_indices_per_request"]), (515, 512))
        self.assertNotIn("verify_mask_cells_needed", at)
        self.assertEqual((at["reachable"], at["reachable_with_fix"]), (True, False))
        self.assertEqual((triton["state"], rc), ("affected", 1))
        self.assertIn(
            "CUDA graphs disabled", self.bug(report, "fa3_page_table")["at_configuration"]["why_not"]
        )

    @unittest.skipUnless(
        os.environ.get("SGLANG_DSA_FIX_FULL") == "1", "make test-full (a slow resolution case)"
    )
    def test_sglang_rejecting_the_arguments_is_one_line(self):
        rc, out, err = run_cli(
            "status",
            "--sglang-root",
            str(self.site),
            "--",
            "--model-path",
            str(self.model),
            "--page-size",
            "x",
        )
        self.assertEqual((rc, out), (2, ""))
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertIn("sglang rejected the launch arguments", err)

    def test_without_sglang_nothing_is_green(self):
        # An interpreter that cannot import sglang's dependencies (no site-packages). A rule
        # standing in for sglang's would read a few flags and miss what sglang forces: here it
        # said "not reachable", exit 0, for a DCP 2 deployment whose allocator pages 2 x P.
        wrapper = self.tmp / "python-without-site"
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S -s "$@"\n')
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        launch = [
            "--model-path",
            str(self.dsa_model),
            *eagle(3, 4, 2048),
            "--dcp-size",
            "2",
            "--tp-size",
            "2",
        ]
        rc, report, _ = self.status(*launch, extra=("--python", str(wrapper)))
        self.assertEqual((rc, report["basis"]), (2, "unresolved"))
        self.assertIn("cannot import sglang", report["basis_note"])
        self.assertIn("pass --python", report["basis_note"])
        self.assertNotIn("configuration", report)
        judged = [b for b in report["bugs"] if b["tree_state"] != "not_applicable"]
        self.assertTrue(judged)
        for bug in judged:
            self.assertEqual((bug["state"], bug["exit_code"]), ("cannot_tell", 2), bug["bug"])
            self.assertIn("did not resolve", bug["at_configuration"]["cannot_tell"])
        with mock.patch.object(trees, "plugin_found_on", return_value=None):
            rc, out, err = run_cli(
                "status", "--sglang-root", str(self.site), "--python", str(wrapper), "--", *launch
            )
        self.assertEqual((rc, err), (2, ""))
        self.assertIn("configuration: cannot tell (", out)
        self.assertNotIn("shape flags", out)  # none were given
        # Whatever the launch arguments (a --config FILE too): the same answer, never a rule's.
        for launch in (["--model-path", "x"], ["--config", "x.yaml"]):
            rc, report, _ = self.status(*launch, extra=("--python", str(wrapper)))
            self.assertEqual((rc, report["basis"]), (2, "unresolved"))


if __name__ == "__main__":
    unittest.main()
