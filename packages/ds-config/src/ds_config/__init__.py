"""ds-config: the one config convention of ds (pydantic only, no torch).

* `Section`: the base of every section model (``ds_comm.CommsLoggerConfig``, ``ds_io.AioConfig``, ...):
  unknown keys are errors with a "did you mean" naming the dotted key path, one strictness policy for
  JSON values, frozen; ``Section.from_ds_config(dict | path)`` picks the section out of a whole
  DeepSpeed config.
* `ConfigError`: what a bad config raises (a ``ValueError``), one line per problem.
* `load_ds_config`: a whole DeepSpeed config from a dict or a JSON file.
* `write_atomic`: temp file, fsync, rename, fsync of the directory.
"""

from ._atomic import write_atomic
from ._section import DEEPSPEED_KEYS, ConfigError, Section, load_ds_config

__version__ = "0.1.0"

__all__ = ["DEEPSPEED_KEYS", "ConfigError", "Section", "__version__", "load_ds_config", "write_atomic"]
