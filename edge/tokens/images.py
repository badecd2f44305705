"""An image's tokens: the processor's placeholder, expanded where an image stands and nowhere else.

The chat template renders each image as the processor's placeholder text (Qwen2.5-VL:
``<|vision_start|><|image_pad|><|vision_end|>``, :func:`edge.chat.conversation.content_with_images`);
the tokenizer makes it its special tokens. :meth:`ImageTokens.expand` then repeats each image's pad
token for as many tokens as the processor gives the image (from its size, no pixel decoded), as
verl's prompt ids hold them, and says where each image's pads are (:class:`schemas.events.ImageRef`).

Text can spell the same special tokens (a user pasting ``<|image_pad|>``, a tool result echoing a
prompt): the tokenizer makes them the very tokens an image gets. They must never make an image
slot, which the model would be trained to see an image in, and which verl's processor would count
as an image with no pixels. So a render's tokens must hold the placeholder's tokens exactly where
the images stand, whole, one placeholder an image, and none anywhere else: otherwise the request is
refused (400, :class:`~schemas.errors.ImageRefused`), never encoded with a slot no image fills.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edge.chat.conversation import ImagePart, Message
from edge.tokens.tokenizer import Tokenizer
from schemas.errors import ImageRefused
from schemas.events import ImageRef
from vision.processor import Processor


class ImageTokens:
    """Placeholders and their expansion for one processor and the tokenizer it goes with."""

    def __init__(self, processor: Processor, tokenizer: Tokenizer) -> None:
        """Raises ``ValueError`` when the processor's placeholder is not special tokens of the tokenizer
        holding its pad token once (then no text could be told from an image)."""
        self.processor = processor
        self.placeholder = processor.placeholder_text
        ids = tuple(tokenizer.encode(self.placeholder))
        if ids.count(processor.pad_id) != 1:
            raise ValueError(f"the processor's placeholder {self.placeholder!r} does not hold its pad token "
                             f"{processor.pad_id} once in the tokenizer {tokenizer.name} ({list(ids)})")
        if not all(tokenizer.is_added_token(tokenizer.id_to_token(t) or "") for t in ids):
            raise ValueError(f"the processor's placeholder {self.placeholder!r} is not special tokens of the "
                             f"tokenizer {tokenizer.name}")
        self._ids = ids
        self._pad_at = ids.index(processor.pad_id)
        self._marks = np.array(sorted(set(ids)), dtype=np.int64)
        self._names = "".join(dict.fromkeys(tokenizer.id_to_token(t) or "" for t in ids))

    @property
    def pad_id(self) -> int:
        return self.processor.pad_id

    def expand(self, ids: Sequence[int], images: Sequence[ImagePart]) -> tuple[list[int], tuple[ImageRef, ...]]:
        """``ids`` (a render whose text held the placeholder once where each of ``images`` stands, in
        order) with each image's pad repeated for its tokens, and the images' places in what comes back.
        Refused (:class:`ImageRefused`) when the placeholder's tokens are anywhere else."""
        marked = np.flatnonzero(np.isin(np.asarray(ids, dtype=np.int64), self._marks)) if len(ids) else ()
        width = len(self._ids)
        if len(marked) != width * len(images):
            raise self._refusal(len(images), len(marked))
        out: list[int] = []
        refs: list[ImageRef] = []
        cut = 0
        for index, image in enumerate(images):
            start = int(marked[index * width])
            if tuple(ids[start:start + width]) != self._ids:
                raise self._refusal(len(images), len(marked))
            info = image.info
            if info is None:
                raise ValueError(f"image {image.param} was not inspected before its tokens were made")
            count = self.processor.image_tokens(info)
            out.extend(ids[cut:start + self._pad_at])
            refs.append(ImageRef(digest=info.digest, media_type=info.media_type, width=info.width,
                                 height=info.height, offset=len(out), tokens=count))
            out.extend([self.pad_id] * count)
            cut = start + self._pad_at + 1
        out.extend(ids[cut:])
        return out, tuple(refs)

    def _refusal(self, images: int, found: int) -> ImageRefused:
        expected = len(self._ids) * images
        counts = f"{images} image(s) in these messages, {found} such tokens where {expected} were expected"
        if found < expected:  # a template that drops or rewrites where an image stands
            return ImageRefused(f"the chat template did not render every image's placeholder ({self._names}) where "
                                f"the image stands ({counts})", param="messages")
        return ImageRefused(f"the text spells the image placeholder's special tokens ({self._names}): only an image "
                            f"makes an image's tokens ({counts}); send images as image parts, not as text",
                            param="messages")


    def check_input(self, ids: Sequence[int], images: int) -> None:
        """Refuse (400) an engine input whose runs of image pads are not one an image: the chain's own tokens
        hold a pad no image put there (a model that sampled one), which the engine would take for an image."""
        pads = np.asarray(ids) == self.pad_id
        runs = int(np.count_nonzero(pads[1:] & ~pads[:-1]) + (1 if len(pads) and pads[0] else 0))
        if runs != images:
            raise ImageRefused(f"the chain holds {runs} runs of image pad tokens for {images} image(s): a pad no image "
                               "put there (sampled by the model?) cannot be sent to the engine; start a new "
                               "conversation", param="messages")


def images_of(messages: Sequence[Message]) -> list[ImagePart]:
    """The images of ``messages``, in order."""
    return [image for message in messages for image in message.images]


def digested(images: Sequence[ImagePart]) -> list[tuple[str, bytes]]:
    """(digest, bytes) of those of ``images`` the edge has inspected (every one that reached a turn's plan)."""
    return [(image.info.digest, image.data) for image in images if image.info is not None]
