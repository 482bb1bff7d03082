"""mkdocs hook: `<!-- help: SUBCOMMAND -->` in a page becomes that command's `--help` text.

The command reference shows the help the installed command prints, never a pasted copy.
`<!-- help: -->` (no subcommand) is the top-level help.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

_MARKER = re.compile(r"<!-- help:\s*([a-z]*)\s*-->")
_ROOT = Path(__file__).resolve().parent.parent


def _help(subcommand: str) -> str:
    args = [sys.executable, "-m", "memory_saving_gradients", *filter(None, [subcommand]), "--help"]
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(_ROOT)}
    result = subprocess.run(args, capture_output=True, text=True, cwd=_ROOT, env=env, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[1:])} failed:\n{result.stderr}")
    return result.stdout.rstrip()


def on_page_markdown(markdown: str, **kwargs) -> str:
    return _MARKER.sub(lambda m: f"```text\n{_help(m.group(1))}\n```", markdown)
