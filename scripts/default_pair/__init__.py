"""Pieces of scripts/train_default_pair.py (one job per module)."""
