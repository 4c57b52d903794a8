"""Config: what the bundle configs hand to the code, read before any work.

- ``values``: ``as_bool``, ``optional_path``, ``require_file`` (config values as the code needs them).
- ``running``: ``running_bundle``, ``parse_command_line``: the config files and overrides of the ``python -m
  monai.bundle run`` command line this process was started with; ``run_config_files``: the files a run of a bundle
  reads (its shared ``common.json`` first), ``check_shared_config``.
- ``overrides``: ``check_overrides``: a command-line override of an id no config has is refused, not added;
  ``defined_overrides``: the overrides one config of a bundle takes.
- ``kinds``: what a setting accepts (``Flag``, ``Integer``, ``Number``, ``OneOf``, ``ListOf`` ...), said in words.
- ``types``: ``check_types``: the running bundle's settings checked against their kinds.

The names are re-exported here and in ``components``, imported on first use.
"""

from __future__ import annotations

from ..lazy import lazy_names

# the modules whose public names (each one's __all__) are offered here
__getattr__, __dir__ = lazy_names(__name__, modules=("overrides", "running", "types", "values"))
