"""Recipes: ready-made pieces for whole post-training runs."""
