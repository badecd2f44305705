"""The trajectory viewer: ``rollbus view``, a small web app over the log.

::

    listing.py   sessions as list rows, filtered and paged by an opaque cursor (pure)
    pieces.py    a chain's tokens as display pieces: text, id, mask, log prob (pure)
    detail.py    one session as the session page draws it (pure)
    store.py     what the app reads: projections for the list, the log (replayed, kept per session and
                 folded on from where it was) for a session
    app.py       the Starlette app: JSON under /api, the static pages (static/: HTML, JS, CSS; no build step)
    server.py    serving it with granian, as the edge is served
"""
