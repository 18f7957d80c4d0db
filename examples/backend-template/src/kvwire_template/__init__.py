"""kvwire-template: a third-party kvwire backend to copy (the transport is an in-process memmove)."""
