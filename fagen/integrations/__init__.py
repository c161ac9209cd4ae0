"""Integrations of fagen into other libraries (each imported only when used)."""
