"""The two versions of ds-all, one place for both.

``DEEPSPEED_API_VERSION`` is the DeepSpeed release whose API ds-all follows. It is what DeepSpeed's names
answer (``deepspeed.__version__``, ``deepspeed.git_version_info.version``, the ``deepspeed`` metadata the
Trainer alias installs), because scripts compare it with the DeepSpeed minimum they need.
``DS_VERSION`` is ds-all's own release (its distribution's version, ``ds_all.__ds_version__``).
"""

DEEPSPEED_API_VERSION = "0.19.8"
DS_VERSION = "0.1.0"
