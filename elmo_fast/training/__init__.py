"""Pretraining (elmo-fast train)."""
