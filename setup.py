"""The one thing pyproject.toml cannot say: golden/ and golden-glm5-next/ of the checkout are the package
data `conformance/golden/` and `conformance/golden_glm5_next/` of the wheel (setuptools' `package_dir`
mapping), without a second copy in git. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

GOLDEN_PACKAGES = {
    "conformance.golden": "golden",
    "conformance.golden.cases": "golden/cases",
    "conformance.golden_glm5_next": "golden-glm5-next",
    "conformance.golden_glm5_next.cases": "golden-glm5-next/cases",
}

setup(
    packages=[
        *find_packages(include=["kda_spec*", "kda_impl*", "dump_gen*", "conformance*"]),
        *GOLDEN_PACKAGES,
    ],
    package_dir=GOLDEN_PACKAGES,
)
