"""ds-all: the whole of ds in one install. For now it assembles the parts and reports them;
``initialize()``, the engine and ``Config`` land here as the packages below arrive.

    >>> import ds_all
    >>> ds_all.versions()        # {'ds-all': '0.1.0', 'ds-launch': '0.1.0', ...}
"""

from ._parts import PARTS, versions

__version__ = "0.1.0"

__all__ = ["PARTS", "__version__", "versions"]
