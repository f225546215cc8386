"""Labelled prompt sets shipped with workbench (JSONL; schema in README.md beside this file).

This folder is the package ``workbench.datasets``. Run tests with ``pytest`` rather than ``python -m pytest``
from the repository root: the latter puts the root on ``sys.path``, where this folder would shadow
Hugging Face's ``datasets``.
"""
