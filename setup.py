"""Build the Cython core. A failed compile is an error, never a fallback."""
import sys

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # pragma: no cover - build-system.requires brings Cython
    sys.exit(
        "shmdist needs Cython >= 3.0 to build its core: pip install 'Cython>=3.0', "
        "or install with pip so that pyproject.toml's build requirements are used."
    )

ext = Extension(
    "shmdist._core",
    sources=["shmdist/_core.pyx"],
    include_dirs=["shmdist"],
    depends=["shmdist/_atomics.h", "shmdist/_half.h", "shmdist/_trace.h", "shmdist/_sum.h", "shmdist/_core.pxd"],
    extra_compile_args=["-O3", "-fno-strict-aliasing", "-fwrapv"],
)

setup(
    ext_modules=cythonize([ext], language_level=3, compiler_directives={"embedsignature": True}),
)
