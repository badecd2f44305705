"""The session domain, pure: the fold (``SessionState``, ``ChainState``), chain selection,
summaries and views. The edge, the projector and the materializer import it; it imports only
``schemas``.
"""
