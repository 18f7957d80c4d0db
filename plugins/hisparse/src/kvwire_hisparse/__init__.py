"""HiSparse split host/device destination backend for kvwire (on the Mooncake transport)."""
