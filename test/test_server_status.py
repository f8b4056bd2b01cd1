"""``sglang-dsa-fix status --url`` against fake servers on 127.0.0.1 (http.server in a thread):
one line and exit 2 for every bad answer, one deadline, a size cap, http(s) only, the API key,
the PD router shape, and the exit code per state family and watch counter."""

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sglang_dsa_fix import cli, members, plugin, server_status
from sglang_dsa_fix.errors import ToolError
from sglang_dsa_fix.server_status import API_KEY_ENV, MAX_BODY, NO_PLUGIN, from_server
from sglang_dsa_fix.verdicts import Bug

REPO = Path(__file__).resolve().parents[1]
BUGS = tuple(bug.value for bug in Bug)  # what the plugin reports: every member
OTHERS = len(BUGS) - 2  # the members after bugs #1 / #2, reported "not_applicable" by ``rank``


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        try:
            self.server.respond(self)
        except OSError:  # the client hung up (deadline, size cap): expected
            pass

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(respond):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.respond, server.seen, server.sent = respond, [], 0
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def answer(data, status=200, headers=()):
    body = data if isinstance(data, bytes) else json.dumps(data).encode()

    def respond(h):
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        for key, value in headers:
            h.send_header(key, value)
        h.end_headers()
        h.wfile.write(body)

    return respond


def rank(*states, watch=None):
    """A rank whose plugin reports ``states`` for the first members, ``not_applicable`` for the rest."""
    states = states + ("not_applicable",) * (len(BUGS) - len(states))
    state = {"version": "0.2.0", "bugs": {b: {"state": s} for b, s in zip(BUGS, states)}, "summary": "s"}
    if watch is not None:
        state["watch"] = watch
    return {"last_gen_throughput": 1.0, plugin.STATE_KEY: state}


def info(*ranks):
    return {"version": "0.5.14", "internal_states": list(ranks)}


def report_for(data, **kwargs):
    with serve(answer(data)) as (_, url):
        return from_server(url, **kwargs)


def tool_error(url, **kwargs) -> str:
    with pytest.raises(ToolError) as caught:
        from_server(url, **kwargs)
    message = str(caught.value)
    assert message and "\n" not in message
    return message


def served_error(respond, **kwargs) -> str:
    with serve(respond) as (_, url):
        return tool_error(url, **kwargs)


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(list(argv))
        except SystemExit as exc:
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)


@pytest.mark.parametrize(
    "data, words",
    [
        ([info(rank("applied"))], "JSON list"),
        ({"version": "x", "internal_states": {"0": {}}}, "internal_states"),
        ({"version": "x"}, "internal_states"),
        (info([1, 2]), "not an object"),
        (info({plugin.STATE_KEY: "applied"}), plugin.STATE_KEY),
        (info({plugin.STATE_KEY: {"bugs": [{"state": "applied"}]}}), "bugs"),
        (info({plugin.STATE_KEY: {"bugs": {"page_table": {"state": 3}}}}), "page_table"),
        (info({plugin.STATE_KEY: {"bugs": {"page_table": "applied"}}}), "page_table"),
        (info(rank("applied", watch=["row_writes_past_end"])), "watch"),
        (info(rank("applied", watch={"enabled": True, "row_columns_past_end": None})), "watch"),
        (info(rank("applied", watch={"row_writes_past_end": "3"})), "watch"),
        ({"prefill": {"0": info()}, "decode": []}, "prefill"),
        ({"prefill": [], "decode": [[]]}, "decode 0"),
    ],
)
def test_wrong_shapes_are_one_line(data, words):
    assert words in served_error(answer(data))


def test_nested_brackets_non_json_non_utf8():
    assert "not JSON" in served_error(answer(b"[" * 200_000))
    assert "not JSON" in served_error(answer(b"<html>hello</html>"))
    assert "not UTF-8" in served_error(answer(b'{"version": "\xff\xfe"}'))


def test_body_cut_short():
    def respond(h):
        h.send_response(200)
        h.send_header("Content-Length", "1000")
        h.end_headers()
        h.wfile.write(b'{"version": "0.5')  # then the handler returns: the connection closes

    assert "cut short" in served_error(respond)


@pytest.mark.parametrize("url", ["http://127.0.0.1:abc", "http://", "http://[::1", "http://127.0.0.1:99999"])
def test_bad_url(url):
    assert "cannot read server info" in tool_error(url)


def test_unreachable():
    with serve(answer({})) as (server, url):
        pass  # closed: nothing listens on that port now
    assert "cannot read server info" in tool_error(url, timeout=5)


def drip_body(h):
    h.send_response(200)
    h.send_header("Content-Length", "100")
    h.end_headers()
    for _ in range(100):
        h.wfile.write(b" ")
        time.sleep(0.5)


def drip_headers(h):
    for byte in b"HTTP/1.0 200 OK\r\nX-Slow: " + b"a" * 100:
        h.wfile.write(bytes([byte]))
        time.sleep(0.5)


@pytest.mark.parametrize("respond", [drip_body, drip_headers])
def test_slow_drip_stops_at_the_deadline(respond):
    start = time.monotonic()
    message = served_error(respond, timeout=2)
    assert time.monotonic() - start < 4
    assert "within 2 s" in message


def test_big_body_refused_without_reading_it():
    def announced(h):
        h.send_response(200)
        h.send_header("Content-Length", str(300_000_000))
        h.end_headers()
        for _ in range(300):
            h.wfile.write(b" " * 1_000_000)
            h.server.sent += 1_000_000

    def unannounced(h):  # HTTP/1.0, no Content-Length: the body ends when the server closes
        h.send_response(200)
        h.end_headers()
        for _ in range(300):
            h.wfile.write(b" " * 1_000_000)
            h.server.sent += 1_000_000

    for respond in (announced, unannounced):
        with serve(respond) as (server, url):
            start = time.monotonic()
            assert "cap" in tool_error(url)
            assert time.monotonic() - start < 10
            time.sleep(0.2)
            assert server.sent < 4 * MAX_BODY, respond.__name__


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/", "gopher://x:70/"])
def test_other_schemes_refused(url):
    assert "only http:// and https://" in tool_error(url)


def test_no_scheme_means_http_and_path_is_server_info():
    with serve(answer(info(rank("applied", "applied")))) as (server, url):
        report = from_server(url.removeprefix("http://"))
        assert report["exit_code"] == 0
        assert report["endpoint"] == url + "/server_info"
        from_server(url + "/server_info/")
        assert [path for path, _ in server.seen] == ["/server_info", "/server_info"]


def test_redirects():
    loop = answer(b"", status=302, headers=[("Location", "/server_info")])
    assert "redirect" in served_error(loop)
    assert "only http://" in served_error(answer(b"", 302, [("Location", "file:///etc/passwd")]))
    with serve(answer(info(rank("applied", "applied")))) as (target, target_url):
        moved = answer(b"", 307, [("Location", target_url + "/server_info")])
        with serve(moved) as (_, url):
            assert from_server(url, api_key="k")["exit_code"] == 0
        assert target.seen == [("/server_info", None)]  # the key stays with the server it was for


def test_api_key(monkeypatch):
    def respond(h):
        if h.headers.get("Authorization") != "Bearer sekret":
            return answer({"error": "Unauthorized"}, status=401)(h)
        return answer(info(rank("applied", "applied")))(h)

    assert "wants an API key" in served_error(answer({"error": "Forbidden"}, status=403))
    with serve(respond) as (server, url):
        assert "wants an API key" in tool_error(url)
        assert "refused the API key" in tool_error(url, api_key="wrong")
        assert from_server(url, api_key="sekret")["exit_code"] == 0
        monkeypatch.setenv(API_KEY_ENV, "sekret")
        assert from_server(url)["exit_code"] == 0
        rc, out, err = run_cli("status", "--url", url, "--api-key", "wrong", "--json")
        assert rc == 2 and "refused the API key" in json.loads(out)["error"]
        assert "sekret" not in out + err


def test_pd_router_shape():
    data = {
        "prefill": [info(rank("applied", "not needed (fixed upstream)"))],
        "decode": [
            info(rank("applied", "applied"), rank("applied", "disabled (SGLANG_DSA_FIX=0)")),
            info(rank("applied", "applied")),
        ],
    }
    report = report_for(data)
    assert report["exit_code"] == 1
    assert report["sglang_version"] == "0.5.14"
    where = [(r["role"], r["server"], r["rank"], r["exit_code"]) for r in report["ranks"]]
    assert where == [("prefill", 0, 0, 0), ("decode", 0, 0, 0), ("decode", 0, 1, 1), ("decode", 1, 0, 0)]
    assert report_for({"prefill": [info(rank("applied"))], "decode": []})["exit_code"] == 0
    assert report_for({"prefill": [], "decode": []})["exit_code"] == 2


def test_watch_counters():
    zero = report_for(info(rank("applied", "applied", watch={"row_writes_past_end": 0})))
    assert zero["exit_code"] == 0 and zero["ranks"][0]["watch"] == {"row_writes_past_end": 0}
    hit = report_for(
        info(rank("applied", "applied"), rank("applied", "applied", watch={"row_writes_past_end": 3}))
    )
    assert hit["exit_code"] == 1
    assert [r["exit_code"] for r in hit["ranks"]] == [0, 1]
    assert any("row_writes_past_end" in note for note in hit["ranks"][1]["notes"])


def test_the_watch_report_the_plugin_really_sends():
    # As seen on the H200 (0.5.17, 2026-12-01): enabled, sites and first_violation beside the counters.
    from sglang_dsa_fix import watch

    real = watch.report()
    assert report_for(info(rank("applied", "applied", watch=real)))["exit_code"] == 0
    hit = {**real, "row_writes_past_end": 8, "row_columns_past_end": 20}
    hit["first_violation"] = {"where": "x", "buffer": "req_to_token", "width": 272, "needed": 276}
    judged = report_for(info(rank("applied", "applied", watch=hit)))
    assert judged["exit_code"] == 1
    assert any(note.startswith("first violation") for note in judged["ranks"][0]["notes"])


@pytest.mark.parametrize(
    "state, code",
    [
        ("applied", 0),
        ("applied (already as wide as req_to_token)", 0),
        ("not needed (fixed upstream)", 0),
        ("installed, not yet called", 0),
        ("not reached at this shape", 0),
        ("not applicable", 0),
        ("hooked (x.y.z); applied on first call", 0),  # legacy, see LEGACY_STATE_EXIT
        ("not covered by this tool", 2),
        ("disabled (SGLANG_DSA_FIX='0')", 1),
        ("unsupported (ImportError: x); sglang untouched", 1),
        ("failed (ValueError: x); sglang's own value kept", 1),
        ("not fixed by the plugin (this release sizes the row inline)", 1),
        # 0.4+: the plugin reports State tokens
        ("protected_by_plugin", 0),
        ("not_reachable", 0),
        ("fixed_upstream", 0),
        ("affected", 1),
        ("cannot_tell", 2),
        ("something new", 1),
        ("", 1),
    ],
)
def test_state_families(state, code):
    assert server_status.state_exit(state) == code
    report = report_for(info(rank("applied", state)))
    assert report["exit_code"] == code
    assert report["ranks"][0]["bugs"]["req_to_token_row"] == {"state": state, "exit_code": code}


def test_plugin_missing_on_a_rank_or_no_ranks():
    report = report_for(info(rank("applied", "applied"), {"last_gen_throughput": 1.0}))
    assert report["exit_code"] == 2 and NO_PLUGIN in report["notes"]
    assert report["ranks"][1]["exit_code"] == 2
    # An affected rank still wins over a rank that cannot be told.
    assert report_for(info(rank("failed (x)"), {}))["exit_code"] == 1
    empty = report_for(info())
    assert empty["exit_code"] == 2 and empty["ranks"] == [] and empty["notes"]


def test_a_member_the_plugin_does_not_report_is_cannot_tell():
    # An image with an older plugin (bugs #1 / #2 only, both protected) under a newer CLI: the
    # members that plugin does not know are unknown on that server, never protected.
    old = {"version": "0.3.0", "bugs": {b: {"state": "applied"} for b in BUGS[:2]}, "summary": "s"}
    with serve(answer(info({plugin.STATE_KEY: old}, {plugin.STATE_KEY: old}))) as (_, url):
        rc, out, err = run_cli("status", "--url", url)
        rc_json, out_json, _ = run_cli("status", "--url", url, "--json")
    assert (rc, rc_json) == (2, 2) and not err
    report = json.loads(out_json)
    assert report["exit_code"] == 2
    for judged in report["ranks"]:
        assert set(judged["bugs"]) == set(BUGS) and judged["exit_code"] == 2
        fa3 = judged["bugs"][Bug.FA3_PAGE_TABLE.value]
        assert (fa3["state"], fa3["exit_code"]) == ("cannot_tell", 2)
        assert "sglang-dsa-fix 0.3.0" in fa3["detail"] and "upgrade" in fa3["detail"]
    [note] = [n for n in report["notes"] if "does not report" in n]  # one for both ranks
    assert note.startswith("the server's plugin (sglang-dsa-fix 0.3.0) does not report fa3_page_table, ")
    lines = out.splitlines()
    assert f"cannot tell for {OTHERS} of {len(BUGS)} — not reported by the server's plugin" in lines[0]
    fa3_line = next(line for line in lines if members.of(Bug.FA3_PAGE_TABLE).title in line)
    assert fa3_line.split()[0] == "cannot_tell" and fa3_line.endswith("cannot_tell on all 2 ranks")
    first = next(line for line in lines if members.of(Bug.PAGE_TABLE).title in line)
    assert first.split()[0] == "protected_by_plugin" and first.endswith("applied on all 2 ranks")
    assert lines[-1] == note
    # A plugin that reports no version is told as such.
    unversioned = {"bugs": {b: {"state": "applied"} for b in BUGS[:2]}}
    assert "(sglang-dsa-fix version unknown)" in report_for(info({plugin.STATE_KEY: unversioned}))["notes"][0]


def test_text_table():
    data = {"prefill": [info(rank("applied", "applied"))], "decode": [info(rank("applied", "failed (x)"))]}
    with serve(answer(data)) as (_, url):
        rc, out, err = run_cli("status", "--url", url)
        rc_v, verbose, _ = run_cli("status", "--url", url, "-v")
        rc_q, quiet, _ = run_cli("status", "--url", url, "-q")
    assert (rc, rc_v, rc_q) == (1, 1, 1) and not err
    lines = out.splitlines()
    assert lines[0].startswith(
        f"server {url}/server_info (sglang 0.5.14, 2 rank(s)): 1 of {len(BUGS)} affected"
    )
    assert quiet.splitlines() == lines[:1]
    at = next(i for i, line in enumerate(lines) if members.of(Bug.ROW_OVERFLOW).title in line)
    assert lines[at].split()[0] == "affected"
    assert [line.strip() for line in lines[at + 1 : at + 3]] == [
        "applied: prefill#0 rank 0",
        "failed (x): decode#0 rank 0",
    ]
    assert max(len(line) for line in lines[1:]) <= 120  # the first: the server's own URL
    # -v: the table by role and rank, one column per member, after the first screen.
    table = verbose.splitlines()[len(lines) :]
    assert table[0].split()[:3] == ["role", "rank", "bug"]
    assert table[1].split() == ["prefill#0", "0", "applied", "applied", *["not_applicable"] * OTHERS, "0"]
    assert table[2].split()[:3] == ["decode#0", "0", "applied"] and table[2].endswith("1")


def cli_subprocess(*argv):
    env = {**os.environ, "PYTHONPATH": str(REPO / "python"), "PYTHONWARNINGS": "ignore"}
    env.pop(API_KEY_ENV, None)
    done = subprocess.run(
        [sys.executable, "-m", "sglang_dsa_fix", "status", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    return done.returncode, done.stdout, done.stderr


def test_cli_json_and_errors():
    with serve(answer(info(rank("applied", "applied"), rank("applied", "not covered by this tool")))) as (
        _,
        url,
    ):
        rc, out, err = cli_subprocess("--url", url, "--json")
    assert rc == 2, err
    report = json.loads(out)
    assert report["exit_code"] == 2
    assert report["ranks"][1]["bugs"]["req_to_token_row"] == {
        "state": "not covered by this tool",
        "exit_code": 2,
    }
    assert set(report["ranks"][0]) >= {"role", "rank", "bugs", "summary", "exit_code"}

    with serve(drip_body) as (_, url):
        start = time.monotonic()
        rc, out, err = cli_subprocess("--url", url, "--timeout", "2", "--json")
    assert rc == 2 and "within 2 s" in json.loads(out)["error"]
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert time.monotonic() - start < 60  # includes the interpreter's start-up

    for argv in (["--url", "http://127.0.0.1:abc"], ["--url", "file:///etc/passwd"], ["--url", ""]):
        rc, out, err = cli_subprocess(*argv, "--json")
        assert rc == 2 and json.loads(out)["exit_code"] == 2
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--url", "http://x", "--timeout", "0"],
        ["--url", "http://x", "--timeout", "nan"],
        ["--url", "http://x", "--timeout", "soon"],
        ["--timeout", "5"],
        ["--api-key", "k"],
    ],
)
def test_cli_flag_errors(argv):
    rc, out, err = run_cli("status", *argv, "--json")
    assert rc == 2 and json.loads(out)["exit_code"] == 2 and err
