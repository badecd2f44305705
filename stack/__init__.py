"""Running rollbus's parts together: the composition of edge, session projector and
materializer in one process (:mod:`stack.runtime`), the embedded ``nats-server`` and its
supervisor (:mod:`stack.nats_server`), the log's streams and buckets
(:mod:`stack.provision`), and the user's mistakes as one line (:mod:`stack.user_error`).
``rollbus up`` (the CLI) and the verl side (:mod:`agent_framework`) both start stacks from here.
"""
