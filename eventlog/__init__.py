"""The event log on JetStream: appending (publisher, acknowledgements), reading a session or
the stream, and durable consumers. The edge appends; the projector, the materializer and replay
read and consume.
"""
