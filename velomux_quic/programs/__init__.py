"""The ``velomux`` command and its programs, built on the library's public surface.

Each subcommand is a module here: :mod:`.certs` (``velomux certs``: a cluster CA and node
certificates), :mod:`.service` (``velomux node``: one node run as a service) with
:mod:`.sink` (the handlers it serves for the probe), :mod:`.probe` (``velomux probe``:
a peer's identity proven and the path to it measured), :mod:`.demo` (``velomux demo``);
:mod:`.cli` dispatches them and :mod:`.runtime` runs each on the best event loop at hand.

A program uses what an application may use: the package root (``velomux_quic``, whose
``__all__`` is the contract), its public modules, and the certificate toolkit
``velomux_quic.security`` exports. It never reaches into a node's layers
(``node.messenger``, ``node.anchors``, ``node.mux``); where a program needed something
the public surface lacked, the node grew a documented method for it.
``tests/unit/test_layering.py`` holds every module here to that.
"""
