"""What a model is, framework-free: configs, presets, sharding rules, kernels."""
