"""Packaging: the repository's top-level folders install as subpackages of ONE import package.

`engine/` installs as `pagedserve.engine`, `kernels/` as `pagedserve.kernels`, and so on, so
that no generic top-level `engine` or `kernels` module lands in site-packages (the `kernels`
package on PyPI, for one, would collide). Everything else is declared in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

SUBPACKAGES = ("engine", "kernels", "parallel", "kv_transfer", "cluster", "bench")

package_dir = {"pagedserve": "pagedserve"}
packages = ["pagedserve"]
for folder in SUBPACKAGES:
    package_dir[f"pagedserve.{folder}"] = folder
    found = find_namespace_packages(include=[folder, f"{folder}.*"], exclude=["*.__pycache__"])
    packages += [f"pagedserve.{name}" for name in found]

setup(
    package_dir=package_dir,
    packages=packages,
    package_data={"pagedserve.kernels": ["cpu/*.cpp", "cpu/*.h"]},
)
