"""What a compiled module's source reads of Cython's ``cython`` module, where it runs as
source and Cython is not installed (Cython is needed to build the record path, not to run
it): only ``compiled``, False here.

A compiled module imports ``cython`` first, and this module only when that import fails:
the compiler needs the import of ``cython`` itself to know the name, and it treats
``cython.compiled`` as a constant, so the branch its module does not run is not even
compiled into the extension.
"""

from __future__ import annotations

from typing import Final

__all__ = ["compiled"]

compiled: Final = False
