"""The wire-neutral conversation every wire decodes into, the deltas a streamed turn tells,
history digests, the bounded cache of the hot paths."""
