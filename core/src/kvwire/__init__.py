"""kvwire: move KV-cache pages between prefill and decode through validated, pluggable backends."""
