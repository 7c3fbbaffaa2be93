"""Data preparation: tokenizers, document sources, fingerprint and quality filters, token shards.

``traind data prepare`` (cli/data.py) runs here, once, before training; the trainer reads what it
wrote through :mod:`traind.data.shards` and the tokenizer through :mod:`traind.data.tokenizer`.
Imports flow one way: trainer and cli import this package; it imports neither.
"""
