"""The Ray Serve application, built from config.

    serve run serve.app:app                      # imperative, config from $DRAFTLINE_CONFIG
    serve run serve/serve_config.yaml            # declarative, the same app
    draftline serve -c configs/tiny-cpu.yaml     # the library path (also rolls on `draftline promote`)

DRAFTLINE_CONFIG names the YAML (default configs/tiny-cpu.yaml, relative to the current directory) and
DRAFTLINE_OVERRIDES holds optional space-separated dotted overrides (e.g. "serve.num_replicas=2").
The engine serves `models:/<name>@champion` resolved when the app is built; see docs/serving.md.
"""

from __future__ import annotations

import os

from draftline.config import load_config
from draftline.serving.app import build_app

DEFAULT_CONFIG = "configs/tiny-cpu.yaml"


def app_from_env():
    config_path = os.environ.get("DRAFTLINE_CONFIG", DEFAULT_CONFIG)
    overrides = os.environ.get("DRAFTLINE_OVERRIDES", "").split()
    return build_app(load_config(config_path, overrides))


app = app_from_env()
