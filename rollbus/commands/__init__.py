"""The CLI's commands, one module each: ``rollbus demo``, ``materialize``, ``replay``,
``rollout``, ``sessions``.
"""
