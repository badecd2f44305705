"""Contract suites: abstract tests that every implementation of a seam must pass (run by the
unit and integration modules that bind them to one implementation each)."""
