"""Build the Cython core. A failed compile is an error, never a fallback."""
import glob
import os
import runpy
import sys

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # pragma: no cover - build-system.requires brings Cython
    sys.exit(
        "shmdist needs Cython >= 3.0 to build its core: pip install 'Cython>=3.0', "
        "or install with pip so that pyproject.toml's build requirements are used."
    )

# The C core reads every shared layout from _layout.h/_layout.pxi, generated from layout.py.
runpy.run_path(os.path.join("shmdist", "layout.py"))["write"]("shmdist")

ext = Extension(
    "shmdist._core",
    sources=["shmdist/_core.pyx"],
    include_dirs=["shmdist"],
    # the hub _core.pyx includes the _*.pxi files; its classes are declared in _core.pxd
    depends=["shmdist/_atomics.h", "shmdist/_half.h", "shmdist/_trace.h", "shmdist/_sum.h", "shmdist/_core.pxd", "shmdist/_layout.h",
             "shmdist/layout.py", *sorted(glob.glob("shmdist/_*.pxi"))],
    extra_compile_args=["-O3", "-fno-strict-aliasing", "-fwrapv"],
)

setup(
    ext_modules=cythonize([ext], language_level=3, compiler_directives={"embedsignature": True}),
)
