"""Mooncake Transfer Engine backend for kvwire (TCP anywhere, RDMA where NICs exist)."""
