"""Integrations with training libraries (TRL)."""
