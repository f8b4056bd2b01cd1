"""``sglang-dsa-fix status --url``: what a live server's plugin reports, per role and rank.

Reads ``/server_info`` under one deadline (connect + headers + body), with a size cap, http and
https only (a redirect never leaves https; the API key goes to the first URL's origin only), and
judges ``internal_states[i]["sglang_dsa_fix"]`` (``plugin.STATE``) of each rank.
Returns data; cli.py renders it. Every failure is a ToolError of one line.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from typing import Optional
from urllib.parse import urljoin, urlsplit

from sglang_dsa_fix import __version__, plugin
from sglang_dsa_fix.errors import EXIT_AFFECTED, EXIT_CANNOT_TELL, EXIT_PROTECTED, ToolError
from sglang_dsa_fix.verdicts import Bug, State, combined_exit

DEFAULT_TIMEOUT = 30.0  # seconds, for connect + headers + body together
MAX_TIMEOUT = 86400.0  # a longer deadline is a typo (and past time_t an OverflowError in socket)
MAX_BODY = 16 << 20  # bytes; a /server_info is a few KiB per rank
MAX_REDIRECTS = 5
CHUNK = 64 << 10
REDIRECTS = (301, 302, 303, 307, 308)
# sglang's own clients send OPENAI_API_KEY as a Bearer token (sglang 0.5.23
# sglang/benchmark/serving.py:131-134, get_auth_headers, also behind sglang.bench_serving).
API_KEY_ENV = "OPENAI_API_KEY"
# A PD router answers {"prefill": [info, ...], "decode": [info, ...]}; sglang 0.5.23
# sglang/benchmark/serving.py:1648-1649 reads server_info["decode"][0] in that case.
PD_ROLES = ("prefill", "decode")

# The plugin reports each bug's ``verdicts.State`` token (its exit code decides). Plugins before
# 0.4 reported free text: judged by prefix -> exit code, first match wins; anything else: affected.
LEGACY_STATE_EXIT = (
    ("applied", EXIT_PROTECTED),
    ("not needed", EXIT_PROTECTED),
    ("installed, not yet called", EXIT_PROTECTED),
    ("not reached", EXIT_PROTECTED),
    ("not applicable", EXIT_PROTECTED),
    ("hooked", EXIT_PROTECTED),  # legacy: hook registered, not yet called
    ("not covered", EXIT_CANNOT_TELL),
    ("cannot tell", EXIT_CANNOT_TELL),
    ("disabled", EXIT_AFFECTED),
    ("unsupported", EXIT_AFFECTED),
    ("failed", EXIT_AFFECTED),
    ("not fixed by the plugin", EXIT_AFFECTED),
)
NO_STATE = "no plugin state on this rank"
# The plugin reports every member of ``Bug`` (``plugin.decide``): a member it leaves out is one
# its (older) release does not know, so what the server does there is unknown, never protected.
UPGRADE = f"upgrade sglang-dsa-fix in the server's image to this tool's {__version__}"
# What the watch reports beside its integer counters (sglang_dsa_fix.watch.report).
WATCH_INFO_KEYS = ("enabled", "sites", "first_violation", "failed")
NO_PLUGIN = (
    "the server does not run the plugin on every rank: run `sglang-dsa-fix check` in the server's environment"
)


def state_exit(state: str) -> int:
    known = State.of_token(state)
    if known is not None:
        return known.exit_code
    return next((code for prefix, code in LEGACY_STATE_EXIT if state.startswith(prefix)), EXIT_AFFECTED)


def _http_parts(url: str):
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):  # file://, ftp://, ... (also as a redirect's target)
        raise ToolError(f"{url}: only http:// and https:// URLs are read")
    return parts


def _origin(url: str) -> tuple:
    """(scheme, host, port) of a URL, the default port filled in: where a key may go."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)  # ValueError on a bad port
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


def endpoint_of(url: str) -> str:
    """``HOST:PORT`` or ``http(s)://HOST:PORT[/prefix]`` -> its ``/server_info`` URL."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url  # as bench_serving builds it from --host/--port
    try:
        parts = _http_parts(url)
    except ValueError as exc:
        raise ToolError(f"{url}: cannot read server info (not a URL: {exc})") from None
    path = parts.path.rstrip("/")
    path = path if path.endswith("/server_info") else path + "/server_info"
    return parts._replace(path=path, query="", fragment="").geturl()


def _get(url: str, headers: dict, deadline: float) -> tuple[int, Optional[str], bytes]:
    """One GET: (status, redirect location, body). The deadline cuts the socket wherever it waits."""
    parts = _http_parts(url)
    host, port = parts.hostname, parts.port  # ValueError on a bad port
    if not host:
        raise ValueError("no host")
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(host, port, timeout=remaining)
    socks = []

    def cut():  # socket timeouts are per recv: a server dripping bytes would outlive them
        for sock in [*socks, conn.sock]:
            if sock is not None:
                try:
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    pass

    watchdog = threading.Timer(remaining, cut)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.connect()
        socks.append(conn.sock)  # getresponse() drops conn.sock on `Connection: close`
        conn.request("GET", parts.path or "/", headers=headers)
        response = conn.getresponse()
        if response.status in REDIRECTS and response.getheader("Location"):
            return response.status, response.getheader("Location"), b""
        if response.status != 200:
            return response.status, None, b""
        length = (response.getheader("Content-Length") or "").strip()
        length = int(length) if length.isdigit() else None
        if length is not None and length > MAX_BODY:
            raise ToolError(f"{url}: answer of {length} bytes, over the {MAX_BODY} byte cap")
        chunks, size = [], 0
        while chunk := response.read1(CHUNK):
            size += len(chunk)
            if size > MAX_BODY:
                raise ToolError(f"{url}: answer over the {MAX_BODY} byte cap")
            if time.monotonic() >= deadline:
                raise TimeoutError
            chunks.append(chunk)
        if time.monotonic() >= deadline:  # the watchdog's cut reads as the end of the body
            raise TimeoutError
        if length is not None and size < length:
            raise http.client.IncompleteRead(b"", length - size)
        return 200, None, b"".join(chunks)
    finally:
        watchdog.cancel()
        conn.close()


def fetch(url: str, timeout: float = DEFAULT_TIMEOUT, api_key: Optional[str] = None) -> tuple[str, object]:
    """(endpoint, parsed JSON) of ``/server_info``, following up to MAX_REDIRECTS redirects."""
    if not 0 < timeout <= MAX_TIMEOUT:  # also NaN
        raise ToolError(f"timeout {timeout!r}: must be above 0 and at most {MAX_TIMEOUT:g} seconds")
    endpoint = current = endpoint_of(url)
    deadline = time.monotonic() + timeout
    try:
        origin = _origin(endpoint)
        for _ in range(MAX_REDIRECTS + 1):
            headers = {"Accept": "application/json"}
            if api_key and _origin(current) == origin:  # the key goes to that origin only
                headers["Authorization"] = f"Bearer {api_key}"
            status, location, body = _get(current, headers, deadline)
            if location is None:
                break
            target = urljoin(current, location)
            if urlsplit(current).scheme == "https" and urlsplit(target).scheme != "https":
                raise ToolError(
                    f"{endpoint}: redirected from https to {target[:200]}: refused (a redirect never "
                    "leaves https)"
                )
            current = target
        else:
            raise ToolError(f"{endpoint}: more than {MAX_REDIRECTS} redirects (a redirect loop?)")
    except ToolError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if time.monotonic() >= deadline:
            raise ToolError(f"{endpoint}: no complete answer within {timeout:g} s (--timeout)") from None
        if isinstance(exc, http.client.IncompleteRead):
            reason = "the answer was cut short"
        else:
            reason = " ".join(f"{type(exc).__name__}: {exc}".split()).rstrip(":")
        raise ToolError(f"{endpoint}: cannot read server info ({reason})") from None
    if status in (401, 403):
        given = "refused the API key" if api_key else "wants an API key"
        raise ToolError(f"{endpoint}: HTTP {status}: the server {given} (--api-key or {API_KEY_ENV})")
    if status != 200:
        raise ToolError(f"{endpoint}: cannot read server info (HTTP {status})")
    try:
        return endpoint, json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        what = "not UTF-8" if isinstance(exc, UnicodeDecodeError) else "not JSON"
        raise ToolError(f"{endpoint}: cannot read server info (the answer is {what})") from None


def _expect(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise ToolError(f"/server_info {where}: {what} (not what sglang and this plugin report)")


def _judge_rank(role: str, server: int, index: int, internal) -> dict:
    where = f"{role} {server} rank {index}" if role in PD_ROLES else f"rank {index}"
    _expect(isinstance(internal, dict), where, "internal state is not an object")
    state = internal.get(plugin.STATE_KEY)
    rank = {"role": role, "server": server, "rank": index, "bugs": {}, "summary": None, "notes": []}
    if state is None:
        rank["notes"].append(NO_STATE)
        rank["exit_code"] = EXIT_CANNOT_TELL
        return rank
    _expect(isinstance(state, dict), where, f"`{plugin.STATE_KEY}` is not an object")
    bugs, watch, summary = state.get("bugs"), state.get("watch"), state.get("summary")
    _expect(isinstance(bugs, dict), where, "the plugin's `bugs` is not an object")
    codes = []
    for name, entry in bugs.items():
        text = entry.get("state") if isinstance(entry, dict) else None
        _expect(isinstance(text, str), where, f"bug {name[:80]!r} has no state string")
        rank["bugs"][name] = {"state": text, "exit_code": state_exit(text)}
        for key in ("hook", "detail"):  # what the hook did, and why (plugins 0.4+)
            if isinstance(entry.get(key), str) and entry[key]:
                rank["bugs"][name][key] = entry[key]
        codes.append(state_exit(text))
    if not bugs:
        rank["notes"].append("the plugin reports no bug")
    version = state.get("version")
    rank["plugin_version"] = version if isinstance(version, str) else None
    rank["unreported"] = [bug.value for bug in Bug if bug.value not in bugs]
    detail = f"not reported by the server's plugin (sglang-dsa-fix {_version(rank)}): {UPGRADE}"
    for name in rank["unreported"]:
        rank["bugs"][name] = {
            "state": State.CANNOT_TELL.token,
            "exit_code": EXIT_CANNOT_TELL,
            "detail": detail,
        }
        codes.append(EXIT_CANNOT_TELL)
    if watch is not None:
        _expect(isinstance(watch, dict), where, "the plugin's `watch` is not an object")
        rank["watch"] = watch
        for counter, value in watch.items():
            if counter in WATCH_INFO_KEYS:
                continue
            _expect(type(value) is int, where, f"the plugin's watch counter {counter} is not an integer")
            if value:  # a width violation happened on this server
                rank["notes"].append(f"watch counter {counter} = {value}")
                codes.append(EXIT_AFFECTED)
        if isinstance(watch.get("first_violation"), dict):
            rank["notes"].append(f"first violation: {watch['first_violation']}")
    rank["summary"] = summary if isinstance(summary, str) else None
    rank["exit_code"] = combined_exit(codes)
    return rank


def _version(rank: dict) -> str:
    return rank.get("plugin_version") or "version unknown"


def judge(info) -> tuple[Optional[str], list]:
    """(sglang version, ranks) of a /server_info answer: one server's, or a PD router's."""
    _expect(isinstance(info, dict), "", f"the answer is a JSON {type(info).__name__}, not an object")
    if "internal_states" in info or not any(role in info for role in PD_ROLES):
        servers = [("server", 0, info)]
    else:
        servers = []
        for role in PD_ROLES:
            _expect(isinstance(info.get(role, []), list), role, "is not a list of server infos")
            servers += [(role, i, server) for i, server in enumerate(info.get(role, []))]
    version, ranks = None, []
    for role, i, server in servers:
        where = f"{role} {i}" if role in PD_ROLES else ""
        _expect(isinstance(server, dict), where, "server info is not an object")
        internal = server.get("internal_states")
        _expect(isinstance(internal, list), where, "has no `internal_states` list")
        if version is None and isinstance(server.get("version"), str):
            version = server["version"]
        ranks += [_judge_rank(role, i, index, state) for index, state in enumerate(internal)]
    return version, ranks


def from_server(url: str, timeout: float = DEFAULT_TIMEOUT, api_key: Optional[str] = None) -> dict:
    """The report for a live server (ToolError if it cannot be read or has the wrong shape)."""
    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    endpoint, info = fetch(url, timeout, api_key)
    version, ranks = judge(info)
    notes = []
    if not ranks:
        notes.append("the server reports no ranks (empty internal_states)")
    elif any(NO_STATE in r["notes"] for r in ranks):
        notes.append(NO_PLUGIN)
    unreported = {}  # plugin version -> the members its ranks leave out: one note per version
    for r in ranks:
        unreported.setdefault(_version(r), {}).update(dict.fromkeys(r.get("unreported", ())))
    notes += [
        f"the server's plugin (sglang-dsa-fix {version}) does not report {', '.join(names)}: "
        f"cannot tell; {UPGRADE}"
        for version, names in unreported.items()
        if names
    ]
    codes = [r["exit_code"] for r in ranks] or [EXIT_CANNOT_TELL]
    members = across_ranks(ranks)
    return {
        "members": members,
        "url": url,
        "endpoint": endpoint,
        "sglang_version": version,
        "ranks": ranks,
        "notes": notes,
        "exit_code": combined_exit(codes),
    }


def rank_label(rank: dict) -> str:
    role = "" if rank["role"] == "server" else f"{rank['role']}#{rank['server']} "
    return f"{role}rank {rank['rank']}"


# A rank's state that is no ``State`` token (a hook word, an older plugin's text), by its exit code.
STATE_OF_EXIT = {
    EXIT_AFFECTED: State.AFFECTED.token,
    EXIT_CANNOT_TELL: State.CANNOT_TELL.token,
    EXIT_PROTECTED: State.PROTECTED_BY_PLUGIN.token,
}


def across_ranks(ranks: list) -> list:
    """Per member (every ``Bug`` the tool knows, then any other a newer plugin reports): the
    state that decides, as a ``State`` token (the rank state whose exit code ``combined_exit``
    keeps), and which ranks reported each state, as they reported it."""
    names = [bug.value for bug in Bug]
    names += [name for rank in ranks for name in rank["bugs"] if name not in names]
    out = []
    for name in dict.fromkeys(names):
        by_state: dict = {}
        for rank in ranks:
            state = rank["bugs"].get(name, {}).get("state", State.CANNOT_TELL.token)
            by_state.setdefault(state, []).append(rank_label(rank))
        if not by_state:
            continue
        worst = combined_exit(state_exit(state) for state in by_state)
        state = next(state for state in by_state if state_exit(state) == worst)
        token = state if State.of_token(state) is not None else STATE_OF_EXIT[worst]
        out.append({"member": name, "state": token, "ranks": by_state})
    return out
