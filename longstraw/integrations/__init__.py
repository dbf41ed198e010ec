"""Integrations with training libraries (TRL, verl) and packed rows."""
