"""The KV layout: the buffers that hold a process's KV cache, their parts, and their wire forms.

Import from the defining module; the public names are also in ``kvwire``.
"""
