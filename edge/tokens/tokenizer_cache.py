"""Where built tokenizers are kept: ``$ROLLBUS_CACHE_DIR``, else ``$XDG_CACHE_HOME/rollbus``,
else ``~/.cache/rollbus``; each file written atomically, so that concurrent processes can race
to build the same one (:mod:`edge.tokens.tokenizer` builds Qwen's from tiktoken ranks,
:mod:`edge.tokens.gguf` SmolLM2's from a GGUF vocabulary).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import tokenizers


def cache_dir() -> Path:
    if explicit := os.environ.get("ROLLBUS_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "rollbus"
    return Path.home() / ".cache" / "rollbus"


def cached_tokenizer(name: str, build: Callable[[], tokenizers.Tokenizer]) -> tokenizers.Tokenizer:
    """The tokenizer cached as ``tokenizers/<name>.json``, built (and cached) when it is not there.
    ``name`` must change whenever what ``build`` makes does (it carries a digest of the inputs)."""
    path = cache_dir() / "tokenizers" / f"{name}.json"
    if not path.is_file():
        write_atomically(path, build().to_str())
    return tokenizers.Tokenizer.from_file(str(path))


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


__all__ = ["cache_dir", "cached_tokenizer", "write_atomically"]
