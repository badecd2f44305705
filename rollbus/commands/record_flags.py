"""The record flags ``rollbus materialize``, ``rollbus up`` and ``rollbus materializer`` share, and what they
give. Light on purpose: it imports nothing of the materializer until a command runs, so that each of these
commands' ``--help`` answers at once (the materializer's modules bring Arrow and pandas)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from schemas.errors import UserError

if TYPE_CHECKING:
    from materializer.padding import Padding
    from materializer.records import RecordOptions


def add_record_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("records")
    group.add_argument("--mask-unfinished-episode", action="store_true",
                       help="records of sessions whose task posted finished=false train nothing (masks zero)")
    group.add_argument("--trajectory-selection", choices=["all", "longest"], default="all",
                       help="every chain of a session, or only its longest [all]")
    group.add_argument("--reward-scorer", metavar="MODULE:ATTR",
                       help="score sessions whose task posted no reward (else their reward is 0)")
    group.add_argument("--prompt-length", type=int, help="write padded rows: prompts left-padded to this length")
    group.add_argument("--response-length", type=int, help="... and responses right-padded to this length")
    group.add_argument("--pad-token-id", type=int, default=0, help="the token id of padding [0]")
    group.add_argument("--overflow", choices=["truncate", "error"], default="truncate",
                       help="a record longer than the padded lengths: cut it (recorded per row) or refuse [truncate]")


def record_options(args: argparse.Namespace) -> RecordOptions:
    from materializer.records import RecordOptions

    return RecordOptions(mask_unfinished_episode=args.mask_unfinished_episode,
                         trajectory_selection=args.trajectory_selection)


def padding(args: argparse.Namespace) -> Padding | None:
    if args.prompt_length is None and args.response_length is None:
        return None
    if args.prompt_length is None or args.response_length is None:
        raise UserError("--prompt-length and --response-length go together")
    from materializer.padding import Padding

    return Padding(prompt_length=args.prompt_length, response_length=args.response_length,
                   pad_token_id=args.pad_token_id, overflow=args.overflow)
