"""The fold carries each chain's images at absolute offsets: across chain starts, contexts, forks and rollbacks."""

import hashlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import envelope
from schemas.errors import FoldError
from schemas.events import ChainStarted, ContextAppended, ForkPoint, ImageRef
from session.fold import fold, release_buffers
from tests.helpers import SessionScript

START, PAD, END = 151652, 151655, 151653


def _image(name: str, offset: int, tokens: int) -> ImageRef:
    return ImageRef(digest=hashlib.sha256(name.encode()).hexdigest(), media_type="image/png", width=28 * tokens,
                    height=28, offset=offset, tokens=tokens)


def _with_images(text: list[int], images: list[tuple[str, int]], at: int = 0) -> tuple[list[int], list[ImageRef]]:
    """``text`` with each image's placeholder (start, pads, end) after it; image offsets counted from ``at``."""
    ids = list(text)
    refs = []
    for name, n in images:
        ids.append(START)
        refs.append(_image(name, at + len(ids), n))
        ids += [PAD] * n + [END]
    return ids, refs


def _pad_runs(ids: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(ids):
        if token != PAD:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def test_context_images_are_placed_after_the_chains_tokens():
    script = SessionScript(processor="builtin:qwen2.5-vl")
    prompt, first = _with_images([1, 2], [("a", 4)])
    script.turn(0, prompt, [7, 8], new_chain=True, images=first)
    context, second = _with_images([3], [("b", 2), ("c", 3)])
    script.turn(0, context, [9], images=second)
    state = fold(script.events)
    (chain,) = state.chains
    assert state.processor == "builtin:qwen2.5-vl"
    assert [(i.offset, i.tokens) for i in chain.images] == _pad_runs(chain.token_ids())
    assert [i.offset for i in chain.images] == [3, len(prompt) + 2 + 2, len(prompt) + 2 + 6]
    assert [i.digest for i in chain.images] == [r.digest for r in (*first, *second)]
    assert release_buffers(state).chains[0].images == ()


@pytest.mark.parametrize("own_only", [False, True])
def test_a_fork_inherits_the_images_inside_the_prefix_it_shares(own_only: bool):
    script = SessionScript()
    prompt, first = _with_images([1, 2], [("a", 4)])
    script.turn(0, prompt, [7, 8], new_chain=True, images=first)
    context, second = _with_images([3], [("b", 2)], at=len(prompt) + 2)
    script.turn(0, context, [9], images=[msgspec.structs.replace(r, offset=r.offset - len(prompt) - 2)
                                         for r in second])
    parent = fold(script.events).chains[0].token_ids()
    shared = len(prompt) + 2 + len(context)  # the child repeats both parent images, then one of its own
    tail, third = _with_images([5], [("c", 1)], at=shared)
    listed = third if own_only else [*first, *second, *third]
    script.turn(1, parent[:shared] + tail, [6], new_chain=True, images=listed,
                fork=ForkPoint(cause="sub_agent", parent=0, message_index=3, token_offset=shared))
    child = fold(script.events).chains[1]
    assert [i.digest for i in child.images] == [r.digest for r in (*first, *second, *third)]
    assert [(i.offset, i.tokens) for i in child.images] == _pad_runs(child.token_ids())


def test_an_image_the_fork_lists_wins_over_the_parents_at_the_same_offset():
    script = SessionScript()
    prompt, first = _with_images([1], [("a", 2)])
    script.turn(0, prompt, [7], new_chain=True, images=first)
    other = [msgspec.structs.replace(first[0], digest=hashlib.sha256(b"z").hexdigest())]  # same size, other image
    script.turn(1, [*prompt, 4], [8], new_chain=True, images=other,
                fork=ForkPoint(cause="sibling", parent=0, token_offset=len(prompt)))
    assert fold(script.events).chains[1].images == tuple(other)


def test_a_rollback_keeps_the_images_in_place():
    script = SessionScript()
    prompt, first = _with_images([1], [("a", 2)])
    script.turn(0, prompt, [7, 7], new_chain=True, images=first)
    context, second = _with_images([3], [("b", 3)])
    script.turn(0, context, [8, 8, 8], images=second)
    before = fold(script.events).chains[0]
    script.roll_back(0, turn_request_no=2, dropped=3)
    rewritten, third = _with_images([4], [("c", 1)])
    script.turn(0, rewritten, [9], images=third)
    chain = fold(script.events).chains[0]
    assert chain.images[:2] == before.images
    assert [(i.offset, i.tokens) for i in chain.images] == _pad_runs(chain.token_ids())


@pytest.mark.parametrize("offset, tokens", [(5, 2), (0, 0), (3, 4)])
def test_an_image_outside_its_events_tokens_does_not_fold(offset: int, tokens: int):
    script = SessionScript()
    script.turn(0, [1, 2, 3, 4, 5, 6], [7], new_chain=True, images=[_image("a", offset, max(tokens, 0))])
    with pytest.raises(FoldError, match="places image"):
        fold(script.events)


def test_overlapping_images_do_not_fold():
    script = SessionScript()
    script.turn(0, [PAD] * 6, [7], new_chain=True, images=[_image("a", 0, 4), _image("b", 2, 2)])
    with pytest.raises(FoldError, match="places image"):
        fold(script.events)


def test_events_without_images_encode_as_before():
    started = ChainStarted(session_id="s", seq=2, time=0.0, chain=0, request_no=1, prompt_ids=b"", prefix_digest="",
                           n_messages=1, chat_turns=1)
    appended = ContextAppended(session_id="s", seq=3, time=0.0, chain=0, request_no=2, token_ids=b"",
                               prefix_digest="", n_messages=1, chat_turns=1)
    for event in (started, appended):
        assert b"images" not in envelope.encode([event])
    script = SessionScript()
    assert b"processor" not in envelope.encode(script.events[:1])
    assert fold(script.events).processor is None


# --- the property: whatever the session does, a chain's images are the placeholder runs of its tokens ----------


class _Model:
    """What a chain should hold, kept naively: its tokens, its images (digest, absolute offset, tokens), and its
    last turn's request and sampled length (for a rollback)."""

    def __init__(self, ids: list[int], images: list[tuple[str, int, int]], request: int, sampled: int) -> None:
        self.ids, self.images, self.request, self.sampled = ids, images, request, sampled


@st.composite
def _sessions(draw: st.DrawFn) -> tuple[SessionScript, list[list[str]]]:
    """A session of chain starts, forks, continued turns and rollbacks, with images anywhere in the context; and
    each chain's image digests in order, as the session should leave them."""
    script = SessionScript()
    chains: list[_Model] = []
    counter = iter(range(10_000))

    def fresh(at: int) -> tuple[list[int], list[ImageRef], list[tuple[str, int, int]]]:
        text = draw(st.lists(st.integers(0, 1000), max_size=4))
        sizes = draw(st.lists(st.integers(1, 4), max_size=2))
        ids, refs = _with_images(text, [(f"i{next(counter)}", n) for n in sizes])
        return ids, refs, [(r.digest, at + r.offset, r.tokens) for r in refs]

    for _ in range(draw(st.integers(1, 8))):
        action = draw(st.sampled_from(["start", "fork", "turn", "turn", "rollback"]))
        sampled = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=3))
        if action == "fork" and chains:
            parent = draw(st.integers(0, len(chains) - 1))
            model = chains[parent]
            cuts = [k for k in range(len(model.ids) + 1) if all(k <= o or k >= o + n for _, o, n in model.images)]
            k = draw(st.sampled_from(cuts))
            inherited = [image for image in model.images if image[1] + image[2] <= k]
            ids, refs, named = fresh(k)
            listed = [msgspec.structs.replace(r, offset=k + r.offset) for r in refs]
            if draw(st.booleans()):  # the edge lists every image of the prompt, those it shares too
                listed = [ImageRef(digest=d, media_type="image/png", width=1, height=1, offset=o, tokens=n)
                          for d, o, n in inherited] + listed
            script.turn(len(chains), model.ids[:k] + ids, sampled, new_chain=True, images=listed,
                        fork=ForkPoint(cause="sub_agent", parent=parent, token_offset=k))
            chains.append(_Model(model.ids[:k] + ids + sampled, inherited + named, script.requests, len(sampled)))
        elif action in ("turn", "rollback") and chains:
            model = chains[draw(st.integers(0, len(chains) - 1))]
            index = chains.index(model)
            if action == "rollback":
                script.roll_back(index, turn_request_no=model.request, dropped=model.sampled)
                del model.ids[len(model.ids) - model.sampled:]
            ids, refs, named = fresh(len(model.ids))
            script.turn(index, ids, sampled, images=refs)
            model.ids += ids + sampled
            model.images += named
            model.request, model.sampled = script.requests, len(sampled)
        else:
            ids, refs, named = fresh(0)
            script.turn(len(chains), ids, sampled, new_chain=True, images=refs)
            chains.append(_Model(ids + sampled, named, script.requests, len(sampled)))
    return script, [[d for d, _, _ in model.images] for model in chains]


@settings(max_examples=150, deadline=None)
@given(_sessions())
def test_a_chains_images_are_the_placeholder_runs_of_its_tokens(session: tuple[SessionScript, list[list[str]]]):
    script, expected = session
    state = fold(script.events)
    assert [[i.digest for i in chain.images] for chain in state.chains] == expected
    for chain in state.chains:
        assert [(i.offset, i.tokens) for i in chain.images] == _pad_runs(chain.token_ids())
