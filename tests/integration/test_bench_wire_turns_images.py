"""``ops/bench/wire_turns.py`` with its image modes runs end to end at its smallest size: an image turn and a text
turn of the same token count in one run, and the log bytes per turn, where a turn that resends the same screenshot
stores none of its bytes again (the object store holds it, and its base64 text, once a session).

This checks that the benchmark works and what it counts, not its speed (read by a person, see
docs/performance.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "ops" / "bench" / "wire_turns.py"


def test_an_image_turn_against_a_text_turn_of_its_tokens_and_the_log_bytes_of_a_resent_image() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--sessions", "2", "--rounds", "1", "--modes", "image",
                           "image-text"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"^\s+image\s+\d+ us\s+x[\d.]+ vs image-text \(the same tokens as text\)$", out, re.MULTILINE), out
    size = int(re.search(r"a (\d+)-byte 640x480 PNG screenshot", out)[1])
    image = re.search(r"^\s+image\s+(\d+) \((\d+) in the object store\), (\d+), (\d+)\s", out, re.MULTILINE)
    assert image is not None, out
    first, stored, second, third = map(int, image.groups())
    # the first turn stores the image once, and the base64 text its body held: both in the object store, so the log's
    # message holds their digests
    assert stored == size + 4 * ((size + 2) // 3) and first - stored < size // 4
    assert second < size // 4 and third < size // 4  # the turns that resend it store a reference, not its bytes
    text = re.search(r"^\s+image-text\s+(\d+), (\d+), (\d+)$", out, re.MULTILINE)
    assert text is not None and all(int(n) < size // 4 for n in text.groups()), out
