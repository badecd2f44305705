"""Shipped example datasets (JSON lines), read with importlib.resources."""
