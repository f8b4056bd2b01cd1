"""Hostile inputs to check / status (issue 25, reliability round 2): a resolution child that
prints junk, floods its output or leaves a grandchild behind, numbers out of range, YAML alias
bombs, FIFOs where the tool reads a file, escape codes from a server, unknown kill-switch
values, a deep leftover tree and redirects that downgrade the scheme. Each ends in one line and
exit 2 (JSON under ``--json``), or in a report that says what it took, never in a traceback, a
hang or unbounded memory."""

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from unittest import mock

from helpers import PatchToolTestCase, run_cli, tree_state

from sglang_dsa_fix import resolve

REPO = Path(__file__).resolve().parents[1]
MARK = resolve.RESULT_MARK
WELL_FORMED = json.dumps(
    {
        "sglang_version": "0.5.14",
        "configuration": {"speculative_algorithm": None, "context_length": 4096, "page_size": 1},
        "sources": {"page_size": "sglang default"},
        "widths": {"row_extra": 4, "decode_reserve": 1, "alloc_page_size": 1},
    }
)


def _fake_python(where: Path, body: str) -> Path:
    """An executable that stands in for the target's interpreter (``--python``)."""
    script = where / "fake-python"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return script


def _alive(pid: int) -> bool:
    """Is the process there and not a zombie?"""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class ResolveChildTestCase(PatchToolTestCase):
    layout = "site-packages"

    def status(self, fake: Path, *extra):
        # As root the tool first asks the interpreter for its sys.path (test_root_safety); the
        # flag lets these cases reach the resolution child itself (the flood case drives the
        # probe too).
        unsafe = ("--allow-unsafe-dirs",) if os.geteuid() == 0 else ()
        return self.cli("status", *extra, *unsafe, "--python", str(fake), "--", "--model-path", "x")

    def assertOneLineError(self, rc, out, err, part=None, json_expected=False):
        self.assertEqual(rc, 2, (out, err))
        self.assertNotIn("Traceback", err)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        if part is not None:
            self.assertIn(part, err)
        if json_expected:
            report = json.loads(out)
            self.assertEqual(report["exit_code"], 2)
            self.assertEqual(report["error"], err.strip().split(": error: ", 1)[1])
        else:
            self.assertEqual(out, "")


class TestResultLineSchema(ResolveChildTestCase):
    """E: the child's result line is parsed with a size cap and a schema."""

    CASES = {
        "junk": "junk{",
        "empty object": "{}",
        "list": "[1, 2]",
        "error without text": '{"error_kind": "import"}',
        "unknown error kind": '{"error_kind": "other", "error": "x"}',
        "wrong type": json.dumps(
            {
                "sglang_version": "0.5.14",
                "configuration": {"context_length": "long"},
                "sources": {},
                "widths": {"row_extra": 1, "decode_reserve": 2},
            }
        ),
        "no widths": json.dumps(
            {
                "sglang_version": "0.5.14",
                "configuration": {"context_length": 4096},
                "sources": {},
                "widths": {},
            }
        ),
        "no allocator page": json.dumps(
            {
                "sglang_version": "0.5.14",
                "configuration": {"context_length": 4096},
                "sources": {},
                "widths": {"row_extra": 1, "decode_reserve": 2, "alloc_page_size": 0},
            }
        ),
    }

    def test_bad_result_lines_are_one_line_exit_2(self):
        for name, line in self.CASES.items():
            fake = _fake_python(self.tmp, f"printf '%s\\n' '{MARK}{line}'\n")
            for extra in ((), ("--json",)):
                with self.subTest(name=name, json=bool(extra)):
                    rc, out, err = self.status(fake, *extra)
                    self.assertOneLineError(rc, out, err, "no result this tool reads", bool(extra))

    def test_oversized_result_line(self):
        size = 2 << 20  # over the cap (1 MiB)
        fake = _fake_python(self.tmp, f"printf '{MARK}'; head -c {size} /dev/zero | tr '\\0' 1; echo\n")
        rc, out, err = self.status(fake, "--json")
        self.assertOneLineError(rc, out, err, "no result this tool reads", True)

    def test_a_well_formed_result_is_still_read(self):
        fake = _fake_python(self.tmp, f"printf '%s\\n' 'noise' '{MARK}{WELL_FORMED}'\n")
        rc, out, err = self.status(fake, "--json")
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out)["basis"], "sglang")


class TestChildOutputCap(ResolveChildTestCase):
    """G: what is read from the child is capped (400 MB on stdout took 1.2 GB)."""

    def peak_rss_mib(self, fake: Path, *extra) -> tuple:
        code = (
            "import resource, sys\n"
            "from sglang_dsa_fix import cli\n"
            "rc = cli.main(sys.argv[1:])\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10, file=sys.stderr)\n"
            "sys.exit(rc)\n"
        )
        argv = [
            "status",
            "--sglang-root",
            str(self.tmp),
            *extra,
            "--python",
            str(fake),
            "--",
            "--model-path",
            "x",
        ]
        done = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300
        )
        *lines, peak = done.stderr.strip().splitlines()
        self.assertTrue(peak.isdigit(), done.stderr[-2000:])
        return done.returncode, lines, int(peak)

    def test_a_flood_on_stdout_is_cut_at_the_cap(self):
        quiet = _fake_python(self.tmp, "exit 3\n")
        _, _, baseline = self.peak_rss_mib(quiet)
        flood = 96 << 20  # the cap is a few MiB: reading it all costs several times this
        fake = _fake_python(self.tmp, f"head -c {flood} /dev/zero\nprintf '\\n%s\\n' '{MARK}{WELL_FORMED}'\n")
        # The resolution child (as root past the sys.path probe: the flag), and as root the probe
        # itself, which runs the same interpreter first: each read is capped, one line, exit 2.
        cases = {"resolution child": (("--allow-unsafe-dirs",), "MiB of output")}
        if os.geteuid() == 0:
            cases["sys.path probe"] = ((), "did not report its sys.path")
        for name, (extra, said) in cases.items():
            with self.subTest(name):
                rc, lines, peak = self.peak_rss_mib(fake, *extra)
                self.assertLess(peak - baseline, 48, f"peak {peak} MiB, {baseline} MiB without the flood")
                self.assertEqual(rc, 2, lines)
                self.assertEqual(len(lines), 1, lines)
                self.assertIn(said, lines[0])


class TestChildProcessGroup(ResolveChildTestCase):
    """L: a grandchild of a hung resolution child does not outlive the deadline."""

    def test_the_whole_group_is_killed_at_the_deadline(self):
        pidfile = self.tmp / "grandchild.pid"
        fake = _fake_python(
            self.tmp, f"sleep 300 </dev/null >/dev/null 2>&1 &\necho $! > {pidfile}\nexec sleep 300\n"
        )
        pid = None
        try:
            with mock.patch.object(resolve, "CHILD_TIMEOUT_S", 2.0):
                start = time.monotonic()
                rc, out, err = self.status(fake)
            self.assertLess(time.monotonic() - start, 30)
            self.assertOneLineError(rc, out, err, "within 2 s")
            pid = int(pidfile.read_text())
            for _ in range(50):  # SIGKILL is delivered at once; the reaping may lag
                if not _alive(pid):
                    break
                time.sleep(0.1)
            self.assertFalse(_alive(pid), f"grandchild {pid} outlived the deadline")
        finally:
            if pid is not None and _alive(pid):
                os.kill(pid, 9)


class TestNumbersInRange(unittest.TestCase):
    """I: numeric options are validated (``--timeout 1e10`` was an OverflowError traceback)."""

    CASES = [
        ["--url", "http://127.0.0.1:1", "--timeout", "1e10"],
        ["--url", "http://127.0.0.1:1", "--timeout", "1e300"],
        ["--url", "http://127.0.0.1:1", "--timeout", "-inf"],
        ["--context-length", "9" * 30, "--speculative-num-draft-tokens", "5"],
        ["--context-length", "4096", "--speculative-num-draft-tokens", "9" * 30],
        ["--context-length", "4096", "--speculative-num-draft-tokens", "5", "--page-size", "9" * 5000],
        ["--context-length", "9" * 5000 + "Ki", "--speculative-num-draft-tokens", "5"],
    ]

    def test_out_of_range_is_one_line_exit_2(self):
        for argv in self.CASES:
            for extra in ((), ("--json",)):
                with self.subTest(argv=[a[:12] for a in argv], json=bool(extra)):
                    rc, out, err = run_cli("status", *argv, *extra)
                    self.assertEqual(rc, 2, (out, err))
                    self.assertNotIn("Traceback", err)
                    self.assertEqual(len(err.strip().splitlines()), 1, err)
                    self.assertLess(len(err), 300, err)
                    if extra:
                        self.assertEqual(json.loads(out)["exit_code"], 2)
                    else:
                        self.assertEqual(out, "")

    def test_the_library_checks_the_deadline_too(self):
        from sglang_dsa_fix import server_status
        from sglang_dsa_fix.errors import ToolError

        for timeout in (1e10, float("nan"), 0.0):
            with self.subTest(timeout=timeout), self.assertRaises(ToolError):
                server_status.from_server("http://127.0.0.1:1", timeout=timeout)


ESC = "\x1b]0;owned\x07\x1b[2J"


class TestControlCharactersEscaped(PatchToolTestCase):
    """K: strings from a server (and from the files) are printed with their control characters
    escaped: no line on the operator's terminal that the input wrote; JSON stays exact."""

    def test_server_info_strings(self):
        from test_server_status import answer, serve

        version = f"0.5.14{ESC}\nbug #1 CUDA-graph page_table width: protected"
        state = {
            "version": "x",
            "bugs": {
                "page_table": {"state": f"applied\r\nFAKE{ESC}"},
                "row\x1b[31m\u202e": {"state": "applied\u2028FAKE"},
            },
            "watch": {f"c{ESC}\nFAKE": 1, "first_violation": {"at": "x\ny"}},
            "summary": "s",
        }
        data = {"version": version, "internal_states": [{"sglang_dsa_fix": state}, {"other": 1}]}
        with serve(answer(data)) as (_, url):
            rc, out, err = run_cli("status", "--url", url)
            rc_json, out_json, _ = run_cli("status", "--url", url, "--json")
        self.assertEqual(rc, 1, err)  # the watch counter
        for char in ("\x1b", "\x07", "\r", "\u2028", "\u202e"):
            self.assertNotIn(char, out)
        self.assertFalse([line for line in out.splitlines() if line.startswith(("FAKE", "bug #1"))], out)
        self.assertIn("\\x1b[2J", out)
        self.assertIn("applied\\r\\nFAKE", out)
        # The verdict, then member lines (indented) and the notes (per rank, then the server's):
        # no line the input started.
        lines = out.splitlines()
        self.assertTrue(lines[0].startswith("server http://"), lines[0])
        self.assertIn("the family watch counted", lines[0])
        starts = ("  ", "rank ", "the server")
        self.assertEqual([line for line in lines[1:] if not line.startswith(starts)], [], out)
        self.assertEqual(len([line for line in lines if line.startswith(("rank ", "the server"))]), 5, out)
        report = json.loads(out_json)
        self.assertEqual((rc_json, report["sglang_version"]), (1, version))
        self.assertEqual(report["ranks"][0]["bugs"]["page_table"]["state"], f"applied\r\nFAKE{ESC}")

    def test_paths_and_errors(self):
        evil = self.tmp / f"tree{ESC}\nbug #2 FAKE"
        evil.mkdir()
        (self.tmp / "python").rename(evil / "python")
        rc, out, err = run_cli("check", "-v", "--sglang-root", str(evil))
        self.assertIn(rc, (0, 1), err)
        self.assertNotIn("\x1b", out)
        starts = ("sglang 0.5.14: ", "bug #", "  ", "note:", "advice:")
        self.assertTrue(all(line.startswith(starts) for line in out.splitlines()), out)
        self.assertFalse(
            [line for line in out.splitlines() if "FAKE" in line and line.startswith("bug #2 F")]
        )
        rc, out, err = run_cli("check", "--sglang-root", str(evil / "nothing\x1b[2J\nhere"))
        self.assertEqual(rc, 2)
        self.assertEqual(len(err.strip().splitlines()), 1, err)
        self.assertNotIn("\x1b", err)


LOL = '["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]'
# Anchors inside one key's value (sglang str()s each list item into an argument): argparse then
# quotes the expansion, some 8 KB per level here (the 9 levels: 118 MB).
ALIAS_BOMB = (
    f"model-path: [&a {LOL}, "
    + ", ".join(f"&{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip("abc", "bcd"))
    + "]\n"
)


class TestConfigFile(unittest.TestCase):
    """F: a --config YAML alias bomb (408 bytes: a 118 MB error line, 1.9 GB) is refused before
    sglang's merger reads it; so is a FIFO (sglang's open() waited on it)."""

    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="dsa-fix-config-"))
        self.addCleanup(shutil.rmtree, self.tmp)

    def status(self, config: Path, *extra):
        with mock.patch.object(resolve, "CHILD_TIMEOUT_S", 60.0):
            return run_cli("status", *extra, "--", "--config", str(config))

    def test_alias_bomb(self):
        bomb = self.tmp / "bomb.yaml"
        bomb.write_text(ALIAS_BOMB)
        self.assertLess(len(ALIAS_BOMB), 400)
        rc, out, err = self.status(bomb, "--json")
        self.assertEqual(rc, 2, err[:2000])
        self.assertEqual(len(err.strip().splitlines()), 1, err[:2000])
        self.assertLess(len(err), 600, err[:2000])
        self.assertIn("27 YAML aliases, more than", err)
        self.assertEqual(json.loads(out)["exit_code"], 2)

    def test_fifo(self):
        fifo = self.tmp / "server.yaml"
        os.mkfifo(fifo)
        start = time.monotonic()
        rc, out, err = self.status(fifo)
        self.assertEqual(rc, 2, err[:2000])
        self.assertIn("not a regular file", err)
        self.assertLess(time.monotonic() - start, 50)


PLUGIN_ENTRY_POINTS = "[sglang.srt.plugins]\nsglang_dsa_fix = sglang_dsa_fix.plugin:register\n"


class TestFifoWhereAFileIsRead(PatchToolTestCase):
    """H: a FIFO at a dist-info METADATA, the package's _version.py, an entry_points.txt or a
    .pth hung check and status for ever; now refused at once (a version file that is not a
    regular file is skipped as an unreadable one is, the others read as absent)."""

    layout = "site-packages"

    def run_tool(self, command: str) -> tuple:
        argv = [sys.executable, "-m", "sglang_dsa_fix", command, "--sglang-root", str(self.tmp), "--json"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=15)
        except subprocess.TimeoutExpired:
            self.fail(f"{command} waited on a FIFO (killed after 15 s)")
        return done.returncode, done.stdout, done.stderr

    def fifo_at(self, relative: str) -> None:
        path = self.tmp / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            path.unlink()
        os.mkfifo(path)

    def plugin_metadata(self, entry_points: bool = True) -> None:
        dist = self.tmp / "sglang_dsa_fix-0.3.0.dist-info"
        dist.mkdir()
        if entry_points:
            (dist / "entry_points.txt").write_text(PLUGIN_ENTRY_POINTS)

    def assertAnswers(self):
        for command in ("check", "status"):
            with self.subTest(command=command):
                rc, out, err = self.run_tool(command)
                self.assertIn(rc, (0, 1), err)
                report = json.loads(out)
                self.assertFalse(report["plugin"]["installed"])

    def test_metadata(self):
        self.fifo_at("sglang-0.5.14.dist-info/METADATA")
        self.assertAnswers()

    def test_version_file(self):
        self.fifo_at("sglang/_version.py")
        self.assertAnswers()
        self.assertIsNone(json.loads(self.run_tool("check")[1])["sglang_version"])  # as unreadable

    def test_entry_points(self):
        self.plugin_metadata(entry_points=False)
        self.fifo_at("sglang_dsa_fix-0.3.0.dist-info/entry_points.txt")
        self.assertAnswers()

    def test_pth(self):
        self.plugin_metadata()
        self.fifo_at("editable.pth")
        self.assertAnswers()

    def test_source_file(self):
        # Issue 34 item 8: a FIFO where a source file is read was taken as "no such file" (at
        # eagle_info_v2.py: the release read as 0.5.4's form; at a backend: not applicable),
        # and apply went on to exit 0. Now it is a file that cannot be read: exit 2.
        for relative in ("srt/speculative/eagle_info_v2.py", "srt/layers/attention/dsa_backend.py"):
            self.fifo_at(f"sglang/{relative}")
            for command in ("check", "status", "apply"):
                with self.subTest(relative=relative, command=command):
                    rc, out, err = self.run_tool(command)
                    self.assertEqual(rc, 2, out)
                    self.assertEqual(len(err.strip().splitlines()), 1, err)
                    self.assertIn(f"{relative}: cannot read (not a regular file)", err)
                    self.assertEqual(json.loads(out)["exit_code"], 2)
            (self.tmp / "sglang" / relative).unlink()
        self.assertEqual(list(self.tmp.rglob("*.orig")), [])  # apply wrote nothing


class TestBoundedParse(PatchToolTestCase):
    """Issue 34 item 8: valid Python with a 900-term expression gave a RecursionError traceback
    (exit 1, no JSON); a 10 MB file a MemoryError under a 3 GiB limit. Both are now one line,
    exit 2, JSON: a file is read up to pysource.MAX_SOURCE_BYTES, and a tree nested deeper than
    pysource.MAX_NESTING is not recognised."""

    def test_deep_expression(self):
        triton = self.package / "srt/layers/attention/triton_backend.py"
        original = triton.read_bytes()
        at = original.index(b"\n    def ", original.index(b"class TritonAttnBackend("))
        # 900 terms: ast.unparse overflows the stack; 3000: ast.parse; 10000 conditionals:
        # CPython's parser runs out of its own stack (MemoryError).
        for expression in (" + ".join(["1"] * 900), " + ".join(["1"] * 3000), "1 if 1 else " * 10000 + "1"):
            method = f"\n    def deep(self):\n        return {expression}\n".encode()
            triton.write_bytes(original[:at] + method + original[at:])
            for command in ("check", "apply"):
                with self.subTest(terms=expression.count("1"), command=command):
                    before = tree_state(self.tmp)
                    rc, out, err = self.cli(command, "--json")
                    self.assertEqual(rc, 2, err[-2000:])
                    self.assertEqual(len(err.strip().splitlines()), 1, err[-2000:])
                    self.assertIn("triton_backend.py: not recognised: nested more than 100 levels deep", err)
                    self.assertEqual(json.loads(out)["exit_code"], 2)
                    self.assertEqual(tree_state(self.tmp), before)

    def test_ten_megabyte_file(self):
        backend = self.package / "srt/layers/attention/dsa_backend.py"
        backend.write_bytes(backend.read_bytes() + b"x = 1\n" * (10 * 2**20 // 6))

        def limit_memory():  # the child's address space: 1 GiB (the parse took more than 3)
            resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))

        argv = [sys.executable, "-m", "sglang_dsa_fix", "check", "--sglang-root", str(self.tmp), "--json"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, preexec_fn=limit_memory)
        self.assertEqual(done.returncode, 2, done.stderr[-2000:])
        self.assertNotIn("Traceback", done.stderr)
        self.assertIn("dsa_backend.py: cannot read (larger than 1048576 bytes)", done.stderr)
        self.assertEqual(json.loads(done.stdout)["exit_code"], 2)


class TestUnknownKillSwitchValue(unittest.TestCase):
    """S: ``SGLANG_DSA_FIX=disable`` meant enabled, silently: now a warning in the plugin's log,
    and the state and ``status`` say the value taken."""

    def register(self, value: str):
        from sglang.srt.plugins.hook_registry import HookRegistry

        from sglang_dsa_fix import plugin

        with (
            mock.patch.dict(os.environ, {plugin.KILL_SWITCH: value}),
            mock.patch.dict(plugin.STATE, {"pid": None, "bugs": {}}),
            mock.patch.object(plugin, "decide", return_value=[]),
            mock.patch.object(HookRegistry, "register"),
        ):
            plugin.register()
            return plugin.STATE["kill_switch"]

    def test_plugin_warns_and_states_the_value_taken(self):
        with self.assertLogs("sglang_dsa_fix", level="WARNING") as logs:
            state = self.register("disable")
        self.assertEqual(len(logs.output), 1, logs.output)
        self.assertIn("SGLANG_DSA_FIX='disable' is not a known value", logs.output[0])
        self.assertIn("taken as enabled", logs.output[0])
        self.assertTrue(state.startswith("SGLANG_DSA_FIX='disable': enabled (not a known value"), state)
        for value, taken in (("off", "disabled"), (" Yes ", "enabled"), ("", "enabled")):
            with self.subTest(value=value), self.assertNoLogs("sglang_dsa_fix", level="WARNING"):
                self.assertEqual(self.register(value), f"SGLANG_DSA_FIX={value!r}: {taken}")

    def test_status_states_the_value_taken(self):
        with mock.patch.dict(os.environ, {"SGLANG_DSA_FIX": "disable"}):
            rc, out, err = run_cli("check", "--json")
        note = json.loads(out)["plugin"]["kill_switch"]
        self.assertIn("any other value but 1 / true / yes / on is taken as enabled", note)
        self.assertIn("here SGLANG_DSA_FIX='disable': enabled (not a known value", note)


class TestDeepLeftoverTree(PatchToolTestCase):
    """T: a 1200-deep tree where sglang was uninstalled (RecursionError in rglob)."""

    @staticmethod
    def remove_chain(top: Path) -> None:
        """top/d/d/...: one level at a time (rglob and rmtree recurse)."""
        while (top / "d").exists():
            if (top / "d" / "d").exists():
                os.rename(top / "d" / "d", top / "t")
                os.rmdir(top / "d")
                os.rename(top / "t", top / "d")
            else:
                os.rmdir(top / "d")

    def test_deep_tree_is_one_line(self):
        (self.package / "__init__.py").unlink()
        (self.package / "srt" / f"common.py{'.sglang-dsa-fix.orig'}").write_text("")
        fd = os.open(self.package / "srt", os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(1200):  # os.makedirs recurses too
            os.mkdir("d", dir_fd=fd)
            fd, parent = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
            os.close(parent)
        os.close(fd)
        self.addCleanup(self.remove_chain, self.package / "srt")
        for command in ("check", "status", "apply"):
            with self.subTest(command=command):
                rc, out, err = self.cli(command)
                self.assertEqual((rc, out), (2, ""), err)
                self.assertNotIn("Traceback", err)
                self.assertEqual(len(err.strip().splitlines()), 1, err[:2000])
                self.assertIn("only at least 1 sglang-dsa-fix backup(s) remain", err)


class TestRedirects(unittest.TestCase):
    """D: a redirect never leaves https, and the API key goes to the first URL's origin only
    (scheme, host and port: https://h to http://h sent it in clear text)."""

    INFO = json.dumps({"version": "0.5.14", "internal_states": []}).encode()

    def fetch(self, url: str, redirects: dict) -> tuple:
        from sglang_dsa_fix import server_status

        seen = []

        def get(current, headers, deadline):
            seen.append((current, headers.get("Authorization")))
            if current in redirects:
                return 302, redirects[current], b""
            return 200, None, self.INFO

        with mock.patch.object(server_status, "_get", side_effect=get):
            try:
                server_status.fetch(url, api_key="sk-secret")
                error = None
            except server_status.ToolError as exc:
                error = str(exc)
        return seen, error

    def test_https_to_http_on_the_same_host_is_refused(self):
        url = "https://srv.test/server_info"
        seen, error = self.fetch(url, {url: "http://srv.test/server_info"})
        self.assertEqual(seen, [(url, "Bearer sk-secret")])  # the http URL is never asked
        self.assertIn("redirected from https to http://srv.test/server_info: refused", error)

    def test_the_key_stays_with_its_origin(self):
        url = "http://srv.test/server_info"
        hops = {
            url: "https://srv.test/server_info",  # another scheme: another origin
            "https://srv.test/server_info": "https://srv.test:8443/server_info",
            "https://srv.test:8443/server_info": "https://other.test/server_info",
        }
        seen, error = self.fetch(url, hops)
        self.assertIsNone(error)
        self.assertEqual([key for _, key in seen], ["Bearer sk-secret", None, None, None])
        # The default port is the same origin.
        seen, _ = self.fetch("http://srv.test/server_info", {url: "http://SRV.test:80/x/server_info"})
        self.assertEqual([key for _, key in seen], ["Bearer sk-secret", "Bearer sk-secret"])
