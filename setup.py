"""Build the compiled record path: the Cython extensions beside their pure-Python twins.

Everything else about the package is in pyproject.toml; this file exists only because the
extensions need code to describe. Cython is a build requirement (``[build-system]``), so
``pip install .``, ``python -m build`` and the sdist on a fresh machine cythonize and compile
with the system C compiler. A compile error fails the build: there is no optional
extension and no silent fallback to the pure-Python twin (see velomux_quic/recordpath).

Every build is stripped (no debug information, no local symbols): a package index takes
the wheels as built, and the debug sections made each extension several times its code.
``VELOMUX_DEBUG_BUILD=1`` keeps them, for a native profiler or a debugger.
"""

from __future__ import annotations

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

COMPILED_MODULES = [
    # Written once as plain Python, with their C declarations in the .pxd beside them:
    # the same file is the pure-Python path (velomux_quic.recordpath's COMPILED_MODULES).
    "velomux_quic.mux.arrival",
    "velomux_quic.mux.batch_codec",
    "velomux_quic.mux.channel",
    "velomux_quic.mux.credit",
    "velomux_quic.mux.egress",
    "velomux_quic.mux.slots",
    "velomux_quic.streaming.channels",
    "velomux_quic.streaming.frames",
    "velomux_quic.streaming.inbox",
    "velomux_quic.streaming.reader",
    "velomux_quic.streaming.sender",
]

EXTENSIONS = [
    # What a compiled module's pure-mode source cannot declare (recordpath's companion).
    Extension(
        "velomux_quic.streaming._reader_send", ["velomux_quic/streaming/_reader_send.pyx"]
    ),
    Extension(
        "velomux_quic.streaming._sender_send", ["velomux_quic/streaming/_sender_send.pyx"]
    ),
    *(Extension(name, [name.replace(".", "/") + ".py"]) for name in COMPILED_MODULES),
]

# Appended after the interpreter's own flags, so -g0 wins over its -g.
if os.environ.get("VELOMUX_DEBUG_BUILD", "") not in ("1", "true", "yes", "on"):
    for extension in EXTENSIONS:
        extension.extra_compile_args.append("-g0")
        extension.extra_link_args.append("-Wl,--strip-all")

setup(
    ext_modules=cythonize(
        EXTENSIONS,
        language_level=3,
        compiler_directives={
            # The twins must raise what the pure code raises: keep Python's semantics for
            # bounds and division, and let profilers see the functions.
            "boundscheck": True,
            "wraparound": True,
            "cdivision": False,
            "embedsignature": True,
            "binding": True,
            # The compiled modules' annotations are for the type checker: Cython's reading
            # of them (``int`` and ``bool`` as exact types) would reject what the pure
            # module accepts. Their C types are in their .pxd files.
            "annotation_typing": False,
        },
    ),
)
