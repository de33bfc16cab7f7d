"""Consumers: see README (built in a later issue)."""
