"""Reports on a user's own data and config: what training would plan, before it runs.

- `config_simulation`: a training YAML's data (through the cached length index) and packing
  section, simulated step by step with fixed batches and with DP alignment;
- `tuning`: the capacity x variation grid and the rule that recommends a point (pure);
- `plots`: the PNG figures (matplotlib, imported lazily);
- `commands`: the ``megatron-packing simulate --config`` / ``tune`` / ``inspect --with-data``
  bodies;
- `progress`: tqdm bars that stay quiet off a terminal.
"""
