"""Reports on a user's own data and config: what training would plan, before it runs.

- `steps`: the one step-simulation engine (`run_steps` -> `StepSeries`, its totals and `cv`);
- `simulation`: fixed B, the exhaustive reference and DP-aligned packing on length pools
  (`pools`: the shipped pools and the streams drawn from them);
- `config_simulation`: a training YAML's data (through the cached length index) and packing
  section, simulated step by step with fixed batches and with DP alignment;
- `dp_balanced_runs`: Megatron-LM's own ``dp_balanced`` packing over fixed B's steps, as a
  `StepSeries`, beside the others in both forms of ``simulate``;
- `tuning`: the capacity x variation grid and the rule that recommends a point (pure);
- `plots`: the PNG figures (matplotlib, imported lazily);
- `arguments`: the options of ``simulate``, ``tune`` and ``calibrate`` on the command line's one
  parser tree;
- `calibration`: ``megatron-packing calibrate`` (`timing_harness`: one layer timed on a GPU;
  `timings_file`: the JSON-lines timings; `packing_keys`: ``--write`` into the YAML);
- `commands`: the ``megatron-packing simulate`` / ``tune`` / ``inspect --with-data`` bodies;
- `progress`: tqdm bars that stay quiet off a terminal.
"""
