"""Release: what turns a trained bundle into one a user downloads and reuses.

- ``package``: ``package_bundle`` (the Model Zoo checks, the zip, its weights and their metrics), ``metadata_schema``.
- ``download``: ``fetch`` / ``fetch_bundle`` with a hash check, ``extract_zip_safely``.
- ``export``: ``export_network`` / ``load_exported`` (``torch.export`` programs bound to their checkpoint).
- ``conversion``: ``convert_checkpoint`` (a published encoder into the layout the bundles load).
- ``origin``: ``report_origin``: which ``components`` code a bundle runs, refused when two bundles' code differ.
- ``startup``: ``start``: what every bundle run does first (one-line errors, its own code, the command line checked).

The names are re-exported here and in ``components``, imported on first use.
"""

from __future__ import annotations

from ..lazy import lazy_names

# the modules whose public names (each one's __all__) are offered here
__getattr__, __dir__ = lazy_names(
    __name__, modules=("conversion", "download", "export", "origin", "package", "startup")
)
