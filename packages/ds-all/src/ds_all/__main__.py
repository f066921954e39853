"""``python -m ds_all``: the version of every part."""

from . import versions

for name, version in versions().items():
    print(f"{name:<12} {version}")
