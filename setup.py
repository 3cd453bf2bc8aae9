"""Maps the repo-root rooms (srt/, lang/, kernels/) into the one `radixlm` import package.

Metadata lives in pyproject.toml; only the package layout needs code, because setuptools
cannot discover sub-packages under a `package-dir` mapping by itself.
"""

from setuptools import find_packages, setup

ROOTS = {"radixlm": "radixlm", "radixlm.srt": "srt", "radixlm.lang": "lang", "radixlm.kernels": "kernels"}

packages: list[str] = []
for pkg, directory in ROOTS.items():
    packages += [pkg] + [f"{pkg}.{sub}" for sub in find_packages(directory)]

# Non-Python sources compiled at run time (the CPU kernels, built and cached on first use).
setup(packages=packages, package_dir=ROOTS, package_data={"radixlm.kernels": ["*.c"]})
