"""The padded form of records: fixed-width rows a trainer can stack. Pure numpy, vectorized.

Layout (verl's): the prompt is **left**-padded to ``prompt_length``, the response
**right**-padded to ``response_length``; ``input_ids`` is their concatenation,
``attention_mask`` 1 on real tokens, ``position_ids = max(cumsum(attention_mask) - 1, 0)``
(0 on the left padding, constant on the right padding), masks, ``rm_scores`` and
``rollout_log_probs`` 0 on padding, and the reward on the last *valid* response position.

A record longer than the padded lengths is, by ``overflow``:

- ``"truncate"`` (the default): the prompt keeps its **last** ``prompt_length`` tokens
  (the context nearest the response), the response its **first** ``response_length``
  tokens (what the model sampled first; the rest never reaches the loss), the reward
  moves to the last kept response token, and the row says ``truncated = true``;
- ``"error"``: :class:`RecordTooLong` names the records that do not fit.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from materializer.options import Padding
from schemas.errors import RecordTooLong
from schemas.records import TrajectoryRecord


class Jagged(msgspec.Struct, frozen=True):
    """Rows of different lengths as one flat array and ``len(rows) + 1`` offsets."""

    values: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, rows: list[np.ndarray]) -> Jagged:
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=offsets[1:])
        values = np.concatenate(rows) if rows else np.zeros(0)
        return cls(values, offsets)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def _left(rows: Jagged, width: int, fill: float, dtype: Any) -> np.ndarray:
    """Each row's last ``width`` values, right-aligned."""
    kept = np.minimum(rows.lengths, width)
    cols = np.arange(width)
    valid = cols[None, :] >= (width - kept)[:, None]
    source = rows.offsets[1:, None] - width + cols[None, :]
    out = np.full((len(kept), width), fill, dtype=dtype)
    out[valid] = rows.values[source[valid]]
    return out


def _right(rows: Jagged, width: int, fill: float, dtype: Any) -> np.ndarray:
    """Each row's first ``width`` values, left-aligned."""
    kept = np.minimum(rows.lengths, width)
    cols = np.arange(width)
    valid = cols[None, :] < kept[:, None]
    source = rows.offsets[:-1, None] + cols[None, :]
    out = np.full((len(kept), width), fill, dtype=dtype)
    out[valid] = rows.values[source[valid]]
    return out


def _rewards(rm_scores: Jagged) -> np.ndarray:
    """The reward of each row: the score on its last response token (0 for an empty response)."""
    lengths = rm_scores.lengths
    out = np.zeros(len(lengths), dtype=np.float32)
    nonempty = lengths > 0
    out[nonempty] = rm_scores.values[rm_scores.offsets[1:][nonempty] - 1]
    return out


def pad(prompts: Jagged, responses: Jagged, response_mask: Jagged, loss_mask: Jagged, rm_scores: Jagged,
        rollout_log_probs: Jagged | None, padding: Padding) -> dict[str, np.ndarray]:
    """The padded columns of a batch, plus the valid ``prompt_len`` / ``response_len`` and ``truncated``."""
    p, r = padding.prompt_length, padding.response_length
    prompt_len = np.minimum(prompts.lengths, p)
    response_len = np.minimum(responses.lengths, r)
    truncated = (prompts.lengths > p) | (responses.lengths > r)
    attention = np.concatenate([np.arange(p)[None, :] >= (p - prompt_len)[:, None],
                                np.arange(r)[None, :] < response_len[:, None]], axis=1).astype(np.int8)
    out_prompts = _left(prompts, p, padding.pad_token_id, np.int32)
    out_responses = _right(responses, r, padding.pad_token_id, np.int32)
    scores = np.zeros((len(response_len), r), dtype=np.float32)
    rows = np.flatnonzero(response_len > 0)
    scores[rows, response_len[rows] - 1] = _rewards(rm_scores)[rows]
    return {
        "prompts": out_prompts,
        "responses": out_responses,
        "input_ids": np.concatenate([out_prompts, out_responses], axis=1),
        "attention_mask": attention,
        "position_ids": np.maximum(np.cumsum(attention, axis=1, dtype=np.int32) - 1, 0).astype(np.int32),
        "response_mask": _right(response_mask, r, 0, np.int8),
        "loss_mask": _right(loss_mask, r, 0, np.int8),
        "rm_scores": scores,
        "rollout_log_probs": None if rollout_log_probs is None else _right(rollout_log_probs, r, 0.0, np.float32),
        "prompt_len": prompt_len.astype(np.int32),
        "response_len": response_len.astype(np.int32),
        "truncated": truncated,
    }


def pad_records(records: list[TrajectoryRecord], padding: Padding) -> dict[str, np.ndarray]:
    """:func:`pad` over records; raises :class:`RecordTooLong` under ``overflow="error"``."""
    logprobs = [r.rollout_log_probs if r.rollout_log_probs is not None else np.zeros(r.response_len, np.float32)
                for r in records]
    out = pad(Jagged.of([r.prompts for r in records]), Jagged.of([r.responses for r in records]),
              Jagged.of([r.response_mask for r in records]), Jagged.of([r.loss_mask for r in records]),
              Jagged.of([r.rm_scores for r in records]), Jagged.of(logprobs), padding)
    check_overflow(out["truncated"], [r.key for r in records], padding)
    return out


def check_overflow(truncated: np.ndarray, keys: list[str], padding: Padding) -> None:
    if padding.overflow == "error" and truncated.any():
        too_long = [keys[i] for i in np.flatnonzero(truncated)]
        raise RecordTooLong(f"{len(too_long)} records exceed prompt_length={padding.prompt_length} / "
                            f"response_length={padding.response_length}: {', '.join(too_long[:5])}")
