"""The built-in demos run by ``bakron demo``."""
