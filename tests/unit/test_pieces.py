"""Piecewise, cached encoding is exactly the tokenizer's own encoding."""

from hypothesis import given, settings
from hypothesis import strategies as st

from edge.tokens.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer("builtin:qwen2.5")
ADDED = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "<think>", "<|endoftext|>"]
texts = st.lists(st.one_of(st.text(max_size=40), st.sampled_from(ADDED), st.sampled_from(["\n", " ", "\n\n", "é"])),
                 max_size=12).map("".join)


def whole(text: str) -> list[int]:
    return TOKENIZER._backend.encode(text, add_special_tokens=False).ids


@settings(max_examples=400, deadline=None)
@given(texts)
def test_piecewise_equals_whole(text):
    assert TOKENIZER.encode(text) == whole(text)
    assert TOKENIZER.encode(text) == whole(text)  # the second time from the cache


def test_rendered_conversation_is_identical_and_cached():
    text = TOKENIZER.chat_template.render(
        [{"role": "system", "content": "sys " * 50}, {"role": "user", "content": "hi\n\n  there"},
         {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                               "function": {"name": "f", "arguments": {"a": 1}}}]},
         {"role": "tool", "content": "  41  def f():\n"}], add_generation_prompt=True)
    assert TOKENIZER.encode(text) == whole(text)
    assert any(piece.startswith("system\n") for piece in TOKENIZER._pieces._cache)


def test_a_long_piece_is_encoded_without_holding_the_gil():
    """While a thread encodes ~0.4 MB of text (about a second), the others keep running: the
    tokenizer's ``encode`` would hold the GIL throughout and freeze the edge's event loop."""
    import itertools
    import random
    import threading
    import time

    from edge.tokens.pieces import RELEASE_GIL_CHARS, PiecewiseEncoder

    rng = random.Random(0)
    vocabulary = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyzäöüßé", k=rng.randint(2, 9))) for _ in range(4000)]
    text = " ".join(rng.choices(vocabulary, k=70_000))
    assert len(text) > 50 * RELEASE_GIL_CHARS
    encoder = PiecewiseEncoder(TOKENIZER._backend)
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.002)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.02)
    started = time.monotonic()
    ids = encoder.encode(text)
    took = time.monotonic() - started
    done.set()
    ticker.join()
    gaps = [later - earlier for earlier, later in itertools.pairwise(ticks) if later > started]
    assert ids == whole(text)
    assert took > 0.05, took  # long enough that holding the GIL would show (~0.8 s here)
    assert max(gaps) < took / 3, (max(gaps), took)


def test_cache_is_bounded():
    from edge.tokens.pieces import PiecewiseEncoder

    encoder = PiecewiseEncoder(TOKENIZER._backend, capacity=8)
    for i in range(50):
        assert encoder.encode(f"<|im_start|>piece {i}<|im_end|>") == whole(f"<|im_start|>piece {i}<|im_end|>")
    assert len(encoder._cache) <= 8


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 151642), st.integers(151643, 151668), st.sampled_from([198, 220, 9707])),
                max_size=40))
def test_table_decoding_equals_the_tokenizer(ids):
    assert TOKENIZER._bytes is not None
    assert TOKENIZER.decode(ids) == TOKENIZER._backend.decode(ids, skip_special_tokens=False)


def test_table_decoding_defers_on_ids_it_does_not_know():
    assert TOKENIZER._bytes.decode([-1]) is None and TOKENIZER._bytes.decode([10**7]) is None
    assert TOKENIZER.decode([9707, 151645]) == "Hello<|im_end|>"


def test_bounded_cache_drops_everything_past_either_bound():
    from edge.chat.cache import BoundedCache

    by_items: BoundedCache[str, int] = BoundedCache(max_items=3, max_bytes=10**6)
    for key in "abcd":
        by_items.put(key, 1)
    assert sorted(by_items) == ["d"]  # the fourth entry started afresh

    by_bytes: BoundedCache[str, int] = BoundedCache(max_items=100, max_bytes=100)
    for key in "abcd":
        by_bytes.put(key, 1, 20)  # 80 bytes held
    by_bytes.put("e", 1, 25)  # 105: past the byte bound, a fresh start
    assert sorted(by_bytes) == ["e"]
    assert by_bytes.put("huge", 2, 26) == 2 and by_bytes.get("huge") is None  # over a quarter: never kept

    pinned: BoundedCache[str, int] = BoundedCache(max_items=2, max_bytes=10**6, pinned={"p": 0})
    for key in "abc":
        pinned.put(key, 1)
    assert sorted(pinned) == ["c"] and len(pinned) == 1 and pinned.get("p") == 0  # kept through the clear
