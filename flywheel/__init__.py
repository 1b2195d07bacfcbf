"""The `flywheel` console script: the one package that may import every other."""
