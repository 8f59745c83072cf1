"""async_rl: asynchronous RL for language models in JAX, after AReaL (arXiv 2505.24298).

Array names carry their shape letters, defined once here:

  B batch (rows)         T tokens (sequence)     V vocabulary
  D model width          F MLP hidden width      E head dimension
  H query heads          K key/value heads       Q query heads per key/value head
  L layers               S generator slots       G samples per group
  N samples (flat)       M micro-batches         R rows per micro-batch
  P prompt tokens        C completion tokens     Z tokens per block
  W CPU threads (`cpu`)

So `logp_BT` is [batch, tokens] and `kv_LSKTE` is [layers, slots, kv heads, tokens,
head dim].
"""
