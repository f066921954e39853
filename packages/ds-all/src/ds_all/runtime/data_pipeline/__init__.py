"""DeepSpeed's ``deepspeed.runtime.data_pipeline`` (the Data Efficiency library: curriculum learning,
data sampling and analysis, random-LTD, variable batch size and learning rate) is not built in ds-all
yet: importing it, or anything below it, is an ImportError that says so, rather than "no module"."""

from importlib.metadata import PackageNotFoundError, version

try:
    _version = version("ds-all")
except PackageNotFoundError:  # a source tree without installed metadata
    _version = "(source tree)"

raise ImportError(f"deepspeed.runtime.data_pipeline (DeepSpeed's Data Efficiency library: curriculum learning, "
                  f"data sampling, random-LTD, variable batch size and learning rate) is not implemented in ds-all "
                  f"{_version}", name=__name__)
