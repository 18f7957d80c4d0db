"""``kvwire bench``: a prefill and a decode process moving a realistic KV cache, every byte verified."""
