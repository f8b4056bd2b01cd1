"""The tool's one error type and its exit codes (README has the table)."""

EXIT_OK = 0  # apply / revert / diff / demo / --version did what was asked
EXIT_PROTECTED = 0  # every bug protected (fixed, fix live, not reachable) or not applicable
EXIT_AFFECTED = 1  # some bug affected and not protected
EXIT_CANNOT_TELL = 2  # error, unrecognised tree, or a bug this tool cannot judge here
EXIT_ERROR = 2  # bad input or an environment the tool cannot work on (``ToolError``)


class ToolError(Exception):
    """Bad input or an environment we cannot work on: one line, exit 2, nothing written."""
