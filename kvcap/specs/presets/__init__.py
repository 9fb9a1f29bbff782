"""Bundled data: model configs (HF config.json files) and the GPU and link catalogs, each value with its source."""
