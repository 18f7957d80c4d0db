"""What kvwire does inside its hosts, and what every host integration shares.

- :mod:`~kvwire.hosts.vllm`: ``KvwireConnector``, vLLM's KV connector over any kvwire backend;
- :mod:`~kvwire.hosts.activation`: the one log line a host process writes when kvwire is active in it;
- :mod:`~kvwire.hosts.host_range`: the host releases kvwire supports, and what happens on another one.

sglang's integration is its own distribution, ``kvwire-sglang`` (``import kvwire_sglang``): sglang loads it
as a plugin. :mod:`kvwire.compat` keeps the old import paths working.
"""
