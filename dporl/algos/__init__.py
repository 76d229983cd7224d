"""Algorithms: torch modules with per-unit losses (or closed-form per-unit directions); they never add noise."""
