"""Checkpoint formats: reading and writing drafters and targets that come from other engines."""
