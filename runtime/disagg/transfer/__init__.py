"""KV transfer backends: one file per backend behind the small interface in base.py."""
