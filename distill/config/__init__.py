"""A run's settings: `TrainConfig`, one typed field per flag with its help text and its checks
(`settings`), and reading them from the command line and a YAML/JSON file (`cli`). Imports only
distill.ops; every layer above reads a `TrainConfig`, none of them parses argv itself.
"""
