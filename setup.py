"""The one compiled part of fedtrust: the order-statistics kernel behind the median and the trimmed mean
(src/fedtrust/aggregators/order_stats.c). Everything else is configured in pyproject.toml. The extension is
optional: without a C compiler the build skips it and the numpy path runs instead
(``fedtrust.aggregators.order_stats.COMPILED`` says which)."""

import sys

from setuptools import Extension, setup

FLAGS = [] if sys.platform == "win32" else ["-O3", "-ffinite-math-only", "-fno-signed-zeros"]

setup(
    ext_modules=[
        Extension(
            "fedtrust.aggregators._order_stats",
            sources=["src/fedtrust/aggregators/order_stats.c"],
            extra_compile_args=FLAGS,
            optional=True,
        )
    ]
)
