"""Build hook for the one optional native piece (dgt/channels/_duplex.c); everything else is in pyproject.toml.
``optional=True``: without a C compiler the install still succeeds and dgt uses the pure-Python hop loop."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("dgt.channels._duplex", ["dgt/channels/_duplex.c"], optional=True,
                             extra_compile_args=["-O3"])])
