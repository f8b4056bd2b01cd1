"""In-tree form of the fix: rewrite the width argument of the graph page_table allocation.

The change is computed from the file on disk (nothing of sglang's is stored here): parse it,
find ``init_cuda_graph_state`` of the backend class, find the ``torch.zeros`` that allocates
``page_table`` and replace exactly its width argument with ``width.REQUIRED_WIDTH_EXPR``,
adding a two-line comment. The original file is kept beside it as ``<file>.sglang-dsa-fix.orig``
so ``revert`` restores the original bytes exactly. Every write is atomic (temp file + rename);
anything unexpected raises ``PatchError`` before a byte is written.
"""

from __future__ import annotations

import ast
import difflib
import enum
import importlib.util
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sglang_dsa_fix import width
from sglang_dsa_fix.backends import ATTENTION_DIR, LAYOUTS, BackendLayout

COMMENT_LINES = (
    b"# Speculative decoding lets seq_len overshoot context_len and req_to_token is",
    b"# over-allocated for it; replay copies req_to_token rows here, so match its width.",
)
BACKUP_SUFFIX = ".sglang-dsa-fix.orig"


class PatchError(Exception):
    """Bad input: reported with exit code 2, nothing written."""


class Verdict(enum.Enum):
    AFFECTED = "affected"
    FIXED_IN_TREE = "fixed in-tree by sglang-dsa-fix"
    FIXED_UPSTREAM = "fixed upstream"
    NOT_APPLICABLE = "no DSA/NSA backend"


@dataclass
class SglangTree:
    package_parent: Path  # checkout/python or site-packages: the directory holding ``sglang/``
    version: Optional[str]

    @property
    def attention_dir(self) -> Path:
        return self.package_parent.joinpath(*ATTENTION_DIR)

    def repo_relative(self, path: Path) -> str:
        """Path as it appears in an sglang git checkout (for diffs)."""
        return "python/" + path.relative_to(self.package_parent).as_posix()


def find_tree(root: Optional[str]) -> SglangTree:
    """An sglang source checkout, a site-packages directory, or (None) the importable sglang."""
    if root is None:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise PatchError("sglang is not importable here; pass --sglang-root DIR")
        package_parent = Path(list(spec.submodule_search_locations)[0]).parent
    else:
        base = Path(root)
        if not base.is_dir():
            raise PatchError(f"{root}: no such directory")
        candidates = [base / "python", base]
        package_parent = next((c for c in candidates if (c / "sglang" / "srt").is_dir()), None)
        if package_parent is None:
            raise PatchError(
                f"{root}: not an sglang tree (expected python/sglang/srt/ for a checkout or "
                "sglang/srt/ for site-packages)"
            )
    package_parent = package_parent.resolve()
    return SglangTree(
        package_parent=package_parent,
        version=_read_version(package_parent / "sglang"),
    )


def _read_version(package: Path) -> Optional[str]:
    # Without importing sglang: _version.py (setuptools-scm, 0.5.9+) or version.py (older).
    for name in ("_version.py", "version.py"):
        try:
            text = (package / name).read_text()
        except OSError:
            continue
        match = re.search(r"^__version__\s*=\s*(?:version\s*=\s*)?[\"']([^\"']+)", text, re.M)
        if match:
            return match.group(1)
    return None


@dataclass
class WidthSite:
    """The width argument of the page_table allocation in one backend file."""

    path: Path
    layout: BackendLayout
    data: bytes  # the file as read
    start: int  # byte offsets of the width expression
    end: int
    lineno: int

    @property
    def expression(self) -> str:
        return self.data[self.start : self.end].decode()


def _is_torch_zeros(node) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "zeros"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
    )


def _zeros_calls(value) -> list:
    """torch.zeros calls that an expression evaluates to (directly or via a conditional)."""
    if isinstance(value, ast.IfExp):
        return _zeros_calls(value.body) + _zeros_calls(value.orelse)
    return [value] if _is_torch_zeros(value) else []


def _page_table_allocations(method: ast.FunctionDef) -> list:
    calls = []
    for node in ast.walk(method):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "page_table":
                    calls += _zeros_calls(value)
        elif isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == "page_table" for t in node.targets):
                calls += _zeros_calls(node.value)
    return calls


def _find_method(tree: ast.Module, class_name: str) -> Optional[ast.FunctionDef]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "init_cuda_graph_state":
                    return item
            return None
    return None


def _byte_offset(data: bytes, lineno: int, col: int) -> int:
    # ast columns are UTF-8 byte offsets; lines counted like the tokenizer (\n, \r\n, \r).
    lines = data.splitlines(keepends=True)
    return sum(len(line) for line in lines[: lineno - 1]) + col


def find_backend_file(tree: SglangTree):
    """(layout, path, parsed module, method) of the first layout whose file defines the class."""
    for layout in LAYOUTS:
        path = tree.attention_dir / layout.filename
        if not path.is_file():
            continue
        data = path.read_bytes()
        try:
            module = ast.parse(data, filename=str(path))
        except SyntaxError as exc:
            raise PatchError(f"{path}: not recognised: does not parse ({exc.msg}, line {exc.lineno})")
        if any(isinstance(n, ast.ClassDef) and n.name == layout.class_name for n in module.body):
            return layout, path, data, module
    return None


def _width_site(path: Path, layout: BackendLayout, data: bytes, module=None) -> WidthSite:
    """The single page_table width argument in ``data``; PatchError unless exactly one."""
    module = module or ast.parse(data)
    method = _find_method(module, layout.class_name)
    if method is None:
        raise PatchError(f"{path}: not recognised: {layout.class_name}.init_cuda_graph_state not found")
    calls = _page_table_allocations(method)
    if len(calls) != 1 or len(calls[0].args) < 2:
        raise PatchError(
            f"{path}:{method.lineno}: not recognised: expected exactly one "
            f"torch.zeros(rows, width, ...) for page_table in "
            f"{layout.class_name}.init_cuda_graph_state, found {len(calls)}"
        )
    arg = calls[0].args[1]
    return WidthSite(
        path=path,
        layout=layout,
        data=data,
        start=_byte_offset(data, arg.lineno, arg.col_offset),
        end=_byte_offset(data, arg.end_lineno, arg.end_col_offset),
        lineno=arg.lineno,
    )


def locate(tree: SglangTree) -> Optional[WidthSite]:
    """The width site, or None where sglang has no DSA/NSA backend. PatchError if unrecognised."""
    found = find_backend_file(tree)
    if found is None:
        return None
    layout, path, data, module = found
    return _width_site(path, layout, data, module)


def _resolves_to_required_width(site: WidthSite) -> bool:
    expr = site.expression
    if expr == width.REQUIRED_WIDTH_EXPR:
        return True
    # 0.5.15+: ``max_ctx_len = self.req_to_token.shape[1]`` then ``max_ctx_len`` (dsa_backend.py:1119).
    if not re.fullmatch(r"[A-Za-z_]\w*", expr):
        return False
    pattern = rb"^\s*" + expr.encode() + rb"\s*=\s*" + re.escape(width.REQUIRED_WIDTH_EXPR.encode()) + rb"\s*$"
    method_text = site.data[: site.start]
    method_text = method_text[method_text.rfind(b"def init_cuda_graph_state") :]
    return re.search(pattern, method_text, re.MULTILINE) is not None


def _line_start(data: bytes, offset: int) -> int:
    return max(data.rfind(b"\n", 0, offset), data.rfind(b"\r", 0, offset)) + 1


def _has_our_comment(site: WidthSite) -> bool:
    line_start = _line_start(site.data, site.start)
    before = site.data[:line_start].splitlines()
    return [line.strip() for line in before[-2:]] == list(COMMENT_LINES)


def patched_bytes(site: WidthSite) -> bytes:
    """The file with the width expression replaced and the two-line comment above it."""
    data = site.data
    line_start = _line_start(data, site.start)
    line = data[line_start : site.start]
    indent = line[: len(line) - len(line.lstrip())]
    line_end = data.find(b"\n", site.start)
    newline = b"\r\n" if data[line_end - 1 : line_end] == b"\r" else b"\n"
    comment = b"".join(indent + text + newline for text in COMMENT_LINES)
    return (
        data[:line_start]
        + comment
        + data[line_start : site.start]
        + width.REQUIRED_WIDTH_EXPR.encode()
        + data[site.end :]
    )


def backup_path(path: Path) -> Path:
    return path.with_name(path.name + BACKUP_SUFFIX)


@dataclass
class Status:
    tree: SglangTree
    verdict: Verdict
    site: Optional[WidthSite] = None
    original: Optional[bytes] = None  # pristine bytes, when known (affected, or our backup)

    def describe(self) -> str:
        version = f"sglang {self.tree.version or '?'}"
        if self.site is None:
            return f"{self.verdict.value}: {version} at {self.tree.package_parent}"
        where = f"{self.site.path}:{self.site.lineno}"
        cls = f"{self.site.layout.class_name}.init_cuda_graph_state"
        if self.verdict is Verdict.AFFECTED:
            return (
                f"affected: {where}: {cls} sizes page_table with `{self.site.expression}`; "
                f"needs `{width.REQUIRED_WIDTH_EXPR}` ({version})"
            )
        return f"{self.verdict.value}: {where}: {cls} ({version})"


def inspect(tree: SglangTree) -> Status:
    """Classify the tree. Raises PatchError when the file is not recognised or was hand-edited."""
    site = locate(tree)
    if site is None:
        return Status(tree, Verdict.NOT_APPLICABLE)
    if _has_our_comment(site):
        backup = backup_path(site.path)
        original = backup.read_bytes() if backup.is_file() else None
        original_site = _site_from_bytes(site, original) if original is not None else None
        if original_site is None or patched_bytes(original_site) != site.data:
            raise PatchError(
                f"{site.path}: changed since sglang-dsa-fix applied it (or {backup.name} is "
                "missing): not touching it; reinstall sglang or restore the file by hand"
            )
        return Status(tree, Verdict.FIXED_IN_TREE, site, original)
    if _resolves_to_required_width(site):
        return Status(tree, Verdict.FIXED_UPSTREAM, site)
    return Status(tree, Verdict.AFFECTED, site, site.data)


def _site_from_bytes(site: WidthSite, data: bytes) -> Optional[WidthSite]:
    """Locate the width site in other bytes of the same file (the backup)."""
    try:
        return _width_site(site.path, site.layout, data)
    except (SyntaxError, PatchError):
        return None


def _ensure_writable(path: Path) -> None:
    # Checked on mode bits too: as root, os.access says yes to a chmod a-w file.
    for target in (path, path.parent):
        mode = target.stat().st_mode
        if not os.access(target, os.W_OK) or not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
            raise PatchError(f"{target}: read-only; nothing changed")


def _atomic_write(path: Path, data: bytes, mode_from: Path) -> None:
    mode = stat.S_IMODE(mode_from.stat().st_mode)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise PatchError(f"{path.parent}: cannot write ({exc.strerror}); nothing changed")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def apply(tree: SglangTree) -> str:
    status = inspect(tree)
    if status.verdict is not Verdict.AFFECTED:
        return f"nothing to do: {status.describe()}"
    site = status.site
    _ensure_writable(site.path)
    new = patched_bytes(site)
    compile(new, str(site.path), "exec")  # never write a file that does not parse
    # Backup first: a crash between the two writes leaves a pristine file and a spare backup.
    _atomic_write(backup_path(site.path), site.data, mode_from=site.path)
    _atomic_write(site.path, new, mode_from=site.path)
    return f"applied: {site.path}:{site.lineno + len(COMMENT_LINES)}: page_table width `{site.expression}` -> `{width.REQUIRED_WIDTH_EXPR}`"


def revert(tree: SglangTree) -> str:
    status = inspect(tree)
    if status.verdict is not Verdict.FIXED_IN_TREE:
        return f"nothing to revert: {status.describe()}"
    site = status.site
    _ensure_writable(site.path)
    _atomic_write(site.path, status.original, mode_from=site.path)
    os.unlink(backup_path(site.path))
    return f"reverted: {site.path} restored to its original bytes"


def upstream_diff(tree: SglangTree) -> str:
    """Unified diff (git-apply-able in an sglang checkout) of the change; '' when none is needed."""
    status = inspect(tree)
    if status.verdict not in (Verdict.AFFECTED, Verdict.FIXED_IN_TREE):
        return ""
    original_site = _site_from_bytes(status.site, status.original)
    before = status.original.decode().splitlines(keepends=True)
    after = patched_bytes(original_site).decode().splitlines(keepends=True)
    name = tree.repo_relative(status.site.path)
    return "".join(difflib.unified_diff(before, after, f"a/{name}", f"b/{name}"))
