"""Fuzz targets for every decoder that reads bytes a peer chose (see docs/reliability.md).

:mod:`fuzz.targets` holds the targets and their oracle, :mod:`fuzz.corpus` the seed corpus
made by the library's own encoders, :mod:`fuzz.mutate` the deterministic mutator the default
test run and the pure-Python driver use, and :mod:`fuzz.run` the driver behind ``make fuzz``
(coverage-guided with atheris when it is installed, the mutator otherwise), and
:mod:`fuzz.replay` the line and branch coverage of each decoder that the corpora reach.
"""
