"""Adapters that plug flashcupy into other libraries (each imports its library on use)."""
