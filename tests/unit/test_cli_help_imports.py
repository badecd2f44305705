"""``rollbus <command> --help`` builds the command's flags without importing what the command runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rollbus.cli import STACK_HELP, TOOLS

HEAVY = ("nats", "pyarrow", "torch", "transformers", "openai", "viewer.server", "stack.runtime", "materializer.records")

PROBE = """
import json, sys
from rollbus.cli import build_parser
parser = build_parser(sys.argv[1])
parser.parse_args([sys.argv[1], "--help"])
"""


@pytest.mark.parametrize("command", sorted([*TOOLS, *STACK_HELP]))
def test_help_imports_nothing_heavy(command: str) -> None:
    # The stack's commands read their record flags' defaults from schemas.records, which builds the Parquet schema
    # (pyarrow) when imported: about 0.1 s, left for now.
    heavy = HEAVY if command in TOOLS else tuple(m for m in HEAVY if m != "pyarrow")
    probe = PROBE.replace('parser.parse_args([sys.argv[1], "--help"])',
                          "try:\n    parser.parse_args([sys.argv[1], '--help'])\nexcept SystemExit:\n    pass\n"
                          f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", probe, command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [], f"rollbus {command} --help imported them"
