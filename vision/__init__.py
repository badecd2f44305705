"""Images: their limits and headers (:mod:`vision.images`), the processor that turns them into placeholder tokens
and model inputs (:mod:`vision.processor`), and a trajectory's vision fields as verl reads them
(:mod:`vision.records`). A low layer: it imports ``schemas`` only; PIL, transformers and torch when used."""
