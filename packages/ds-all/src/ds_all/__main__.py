"""``python -m ds_all``: the version of every part."""

import argparse

from . import versions

argparse.ArgumentParser(prog="python -m ds_all", description="Print the installed version of ds-all and of "
                        "every ds package it is made of.").parse_args()
for name, version in versions().items():
    print(f"{name:<12} {version}")
