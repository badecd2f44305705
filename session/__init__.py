"""The session domain, pure: the fold (``SessionState``, ``ChainState``), chain selection, a turn
decided (its plan and its numbered events: :mod:`session.turn`, :mod:`session.numbering`),
summaries and views. The edge, the projector and the materializer import it; it imports only
``schemas``.
"""
