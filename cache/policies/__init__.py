"""Each cache policy's class (its record in config/policies.py names it)."""
