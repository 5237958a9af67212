"""Packaging for dsv4_nvfp4: every field comes from settings.ini, the one place nbdev and pip share."""
from configparser import ConfigParser
from pathlib import Path

import setuptools

cfg = ConfigParser(delimiters=["="])
cfg.read(Path(__file__).parent / "settings.ini", encoding="utf-8")
c = cfg["DEFAULT"]

licenses = {"apache2": ("Apache Software License 2.0", "OSI Approved :: Apache Software License")}
statuses = ["Planning", "Pre-Alpha", "Alpha", "Beta", "Production/Stable", "Mature", "Inactive"]
lic = licenses[c["license"]]
requirements = c.get("requirements", "").split()
dev_requirements = c.get("dev_requirements", "").split()
gpu_requirements = c.get("gpu_requirements", "").split()   # CUDA-only packages: the [gpu] extra
readme = Path(__file__).parent / "README.md"

setuptools.setup(
    name=c["lib_name"],
    version=c["version"],
    description=c["description"],
    long_description=readme.read_text(encoding="utf-8") if readme.exists() else c["description"],
    long_description_content_type="text/markdown",
    author=c["author"],
    author_email=c["author_email"],
    url=c["git_url"],
    license=lic[0],
    keywords=c["keywords"].split(),
    classifiers=[
        f"Development Status :: {int(c['status']) + 1} - {statuses[int(c['status'])]}",
        f"Intended Audience :: {c['audience'].title()}",
        f"License :: {lic[1]}",
        f"Natural Language :: {c['language'].title()}",
        "Programming Language :: Python :: 3",
    ],
    python_requires=f">={c['min_python']}",
    packages=setuptools.find_packages(include=[c["lib_path"], c["lib_path"] + ".*"]),
    include_package_data=True,
    # the CUDA sources are compiled at run time: a wheel installs them under <prefix>/share/dsv4_nvfp4/kernels_cu
    data_files=[("share/dsv4_nvfp4/kernels_cu", sorted(str(p) for p in Path("kernels_cu").glob("*.cu*")))],
    install_requires=requirements,
    extras_require={"dev": dev_requirements, "gpu": gpu_requirements},
    entry_points={
        "console_scripts": c["console_scripts"].split(),
        "nbdev": [f"{c['lib_path']}={c['lib_path']}._modidx:d"],
    },
    zip_safe=False,
)
