"""Build hook for the optional native pieces (dgt/channels/_duplex.c, dgt/protocol/_nh.c, dgt/protocol/_blockops.c);
everything else is in pyproject.toml. ``optional=True``: without a C compiler the install still succeeds and dgt uses
the pure-Python hop loop, the numpy NH hash and the torch block passes (same results, slower)."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("dgt.channels._duplex", ["dgt/channels/_duplex.c"], optional=True, extra_compile_args=["-O3"]),
    Extension("dgt.protocol._nh", ["dgt/protocol/_nh.c"], optional=True, extra_compile_args=["-O3"]),
    Extension("dgt.protocol._blockops", ["dgt/protocol/_blockops.c"], optional=True,
              extra_compile_args=["-O3", "-pthread"], extra_link_args=["-pthread"]),  # passes split over threads
])
