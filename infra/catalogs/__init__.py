"""The catalogs a stack is checked against: TPU, GPU and Dataflow regions, each with its yaml."""
