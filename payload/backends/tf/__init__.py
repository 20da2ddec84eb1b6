"""The TensorFlow backend (`train.backend: tf`): the frozen TF line, on one host.

TensorFlow's TPU build with transformers' TF classes on tf_keras, one host (TPU v2-v5, GPU,
CPU). Frozen: new families, objectives and sharding go to the JAX backend; this one refuses
what it does not have in one line."""
