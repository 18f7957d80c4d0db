"""Backends shipped in the core distribution."""
