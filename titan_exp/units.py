"""Units the project's figures are written in."""

GIB, MIB = 1024**3, 1024**2
