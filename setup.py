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
}

packages, package_dir = [], {}
for name, folder in FOLDERS.items():
    package_dir[name] = folder
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir, package_data={"meridian.api": ["static/*"]})
