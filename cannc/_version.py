"""cannc's version, apart from the package root so that any layer may read it."""

__version__ = "0.1.0"
