"""flexfa's version: part of every cache key, so it lives below every layer that keys a cache."""

__version__ = "0.1.0"
