"""Write ``docs/cli.md``, the CLI reference, from the parser itself (``rollbus.cli.build_parser``).

    python ops/docs/cli_reference.py          # rewrite docs/cli.md
    python ops/docs/cli_reference.py --check  # exit 1 when docs/cli.md is not what the parser says

``tests/unit/test_docs.py`` runs the check, so a flag added or changed without this page is a failing test.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "cli.md"
WIDTH = "100"  # the columns argparse wraps the help at, whatever the terminal


def render() -> str:
    os.environ["COLUMNS"] = WIDTH  # read by argparse's formatter when it is created
    sys.path.insert(0, str(ROOT))
    from rollbus.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parts = ["# CLI reference\n",
             "Every command's `--help`, as the parser prints it (written by `ops/docs/cli_reference.py`; a test",
             "fails when this page and the parser disagree). Mistakes are answered in one line on stderr with",
             "exit status 2.\n",
             "```text", parser.format_help().rstrip(), "```\n"]
    for name, sub in commands.choices.items():
        parts += [f"## rollbus {name}\n", "```text", sub.format_help().rstrip(), "```\n"]
    return "\n".join(parts)


def main() -> int:
    check = "--check" in sys.argv[1:]
    text = render()
    if check:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python ops/docs/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
