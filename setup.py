"""The one thing pyproject.toml cannot say: golden/ of the checkout is the package data
`conformance/golden/` of the wheel (setuptools' `package_dir` mapping), without a second copy in git.
Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

GOLDEN_PACKAGES = {"conformance.golden": "golden", "conformance.golden.cases": "golden/cases"}

setup(
    packages=[
        *find_packages(include=["kda_spec*", "kda_impl*", "dump_gen*", "conformance*"]),
        *GOLDEN_PACKAGES,
    ],
    package_dir=GOLDEN_PACKAGES,
)
