"""ds-launch: DeepSpeed's launcher for ds, standard library only (it never imports torch).

Run ``ds-launch --help``. The public API is the command line (`main`) plus the pieces a program
may want to reuse: hostfile parsing and resource selection.
"""

__version__ = "0.1.0"

from .cli import main
from .resources import LaunchError, parse_hostfile, select_resources

__all__ = ["LaunchError", "__version__", "main", "parse_hostfile", "select_resources"]
