"""Packages are discovered, never listed by hand: a list by hand once shipped a wheel without
``meridian.api.routes``. The repository keeps the layout api/ service/ workers/ bench/; they install under
one import name so nothing called bare ``api`` or ``service`` lands in site-packages."""

from setuptools import find_packages, setup

FOLDERS = {
    "meridian": "meridian",
    "meridian.api": "api",
    "meridian.service": "service",
    "meridian.workers": "workers",
    "meridian.bench": "bench",
    "meridian.cli": "cli",
    "meridian.lab": "lab",
}
# Data-only folders that ship beside the code: `meridian demo` runs examples/demo.json by default, from
# site-packages/meridian/examples in an installed wheel (an editable install reads the repository's).
DATA_FOLDERS = {"meridian.examples": ("examples", ["**/*.json", "**/*.yaml"])}

packages, package_dir = [], {}
for name, folder in FOLDERS.items():
    package_dir[name] = folder
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

# The lab's C delay line is compiled on the machine that runs the lab (meridian lab up), so its source ships.
package_data = {"meridian.api": ["static/*"], "meridian.lab": ["*.c"]}
for name, (folder, patterns) in DATA_FOLDERS.items():
    packages.append(name)
    package_dir[name] = folder
    package_data[name] = patterns

setup(packages=packages, package_dir=package_dir, package_data=package_data)
