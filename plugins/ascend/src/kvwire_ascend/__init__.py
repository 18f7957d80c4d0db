"""Ascend NPU backend for kvwire (torch_npu + Mooncake Ascend transport)."""
